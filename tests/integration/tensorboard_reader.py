"""Reads a folder of TensorBoard event files with TensorBoard's own readers and prints JSON.

    tensorboard_reader.py FOLDER

prints one object:

- "scalars": {tag: [[step, value, wall_time], ...]} as TensorBoard's server shows them (its
  plugin event accumulator: a SessionLog START drops what was written at and after its step
  before it);
- "texts": {tag: [[step, text], ...]} (the text plugin's string tensors), the same way;
- "raw": {tag: [step, ...]} every summary value in every file, in file order, with nothing
  dropped (TensorBoard's event file loader, one file at a time);
- "starts": [step, ...] the SessionLog STARTs, in file order;
- "files": the event files' names, sorted as TensorBoard reads them.
"""

import json
import os
import sys

from tensorboard.backend.event_processing import event_file_loader, plugin_event_accumulator
from tensorboard.util import tensor_util


def main(folder):
    acc = plugin_event_accumulator.EventAccumulator(
        folder, size_guidance={plugin_event_accumulator.TENSORS: 0})
    acc.Reload()
    scalars, texts = {}, {}
    for tag in acc.Tags()["tensors"]:
        plugin = acc.SummaryMetadata(tag).plugin_data.plugin_name
        for e in acc.Tensors(tag):
            value = tensor_util.make_ndarray(e.tensor_proto).item()
            if plugin == "scalars":
                scalars.setdefault(tag, []).append([e.step, value, e.wall_time])
            elif plugin == "text":
                texts.setdefault(tag, []).append([e.step, value.decode("utf-8")])
    files = sorted(f for f in os.listdir(folder) if "tfevents" in f)
    raw, starts = {}, []
    for name in files:
        for event in event_file_loader.EventFileLoader(os.path.join(folder, name)).Load():
            if event.HasField("session_log") and event.session_log.status == 1:
                starts.append(event.step)
            for v in event.summary.value:
                raw.setdefault(v.tag, []).append(event.step)
    print(json.dumps({"scalars": scalars, "texts": texts, "raw": raw, "starts": starts,
                      "files": files}))


if __name__ == "__main__":
    main(sys.argv[1])
