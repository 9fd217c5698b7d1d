"""The exporter's note (``extra/diffmon.json`` in every file the exporter writes): its version.

The note is the one contract between this exporter and the daemon, which reads it typed
(``src/engine/model/note.rs``): a versioned note with a field the daemon does not know is refused
there, so a field added or renamed here needs the same change on the Rust side and a new
``NOTE_VERSION`` when older daemons could misread it. ``python/tests/test_export_note.py`` passes
every exporter option through the daemon's reader.
"""

NOTE_VERSION = 1
