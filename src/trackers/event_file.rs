//! TensorBoard's event-file format, written and read back without TensorFlow (docs/design.md
//! §21): a file is a sequence of records, each the 8-byte little-endian length of its data, the
//! masked CRC-32C of those 8 bytes, the data, and the masked CRC-32C of the data (the mask:
//! rotate right by 15 bits, add `0xa282ead8`). Each record's data is an `Event` protocol buffer:
//! `wall_time` (1, double), `step` (2, int64), then one of `file_version` (3, string: the first
//! record, `brain.Event:2`), `summary` (5) or `session_log` (7). A `Summary` holds `Value`s: `tag`
//! (1) and `simple_value` (2, float) for a scalar; text is a string tensor (8) whose metadata (9)
//! names the `text` plugin.
//!
//! The encoder writes exactly these fields. The decoder reads what the writer needs back
//! ([`EventHead`]: the time, the step and what the record is), from files anyone may have
//! written: every length is checked against what is left, a record over [`MAX_RECORD`] bytes or
//! with a wrong checksum ends the read with an error, unknown fields are skipped, and nothing is
//! nested deeper than a `Value`.

/// The version string of the first record: TensorBoard treats version 2 files as ones whose
/// restarts are marked by a `SessionLog` START (the reader drops what an abandoned run wrote at
/// and after that step).
pub const FILE_VERSION: &str = "brain.Event:2";

/// The longest record the reader accepts. diffmon's own are under 4 KiB.
pub const MAX_RECORD: u64 = 1 << 20;

/// The CRC-32C (Castagnoli) table, reflected polynomial 0x82F63B78.
const CRC_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0x82F6_3B78
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

/// The CRC-32C of `bytes`.
pub fn crc32c(bytes: &[u8]) -> u32 {
    !bytes.iter().fold(!0u32, |c, &b| {
        CRC_TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8)
    })
}

/// The masked CRC-32C TensorFlow's record format stores.
pub fn masked_crc(bytes: &[u8]) -> u32 {
    crc32c(bytes).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// `data` framed as one record.
pub fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

#[derive(Debug, PartialEq, thiserror::Error)]
pub enum FormatError {
    #[error("the record at byte {0} has a wrong length checksum")]
    LengthChecksum(usize),
    #[error("the record at byte {0} is {1} bytes long, over the {MAX_RECORD} accepted")]
    TooLong(usize, u64),
    #[error("the record at byte {0} has a wrong data checksum")]
    DataChecksum(usize),
    #[error("a record's protocol buffer is malformed ({0})")]
    Malformed(&'static str),
}

/// The records of a file's bytes, in order, and whether the file ends in a torn record (a
/// writer killed mid-write, or one still writing): that one is left out.
pub fn records(bytes: &[u8]) -> Result<(Vec<&[u8]>, bool), FormatError> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let rest = &bytes[at..];
        if rest.len() < 12 {
            return Ok((out, true));
        }
        let (len_bytes, crc) = (
            &rest[..8],
            u32::from_le_bytes(rest[8..12].try_into().unwrap()),
        );
        if masked_crc(len_bytes) != crc {
            return Err(FormatError::LengthChecksum(at));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap());
        if len > MAX_RECORD {
            return Err(FormatError::TooLong(at, len));
        }
        let len = len as usize;
        if rest.len() < 12 + len + 4 {
            return Ok((out, true));
        }
        let data = &rest[12..12 + len];
        let crc = u32::from_le_bytes(rest[12 + len..16 + len].try_into().unwrap());
        if masked_crc(data) != crc {
            return Err(FormatError::DataChecksum(at));
        }
        out.push(data);
        at += 16 + len;
    }
    Ok((out, false))
}

// ------------------------------------------------------------------------------------------------
// Encoding

/// One value of a summary.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Scalar(f32),
    /// Shown by TensorBoard's text plugin (markdown).
    Text(String),
}

/// What an event holds besides its time and step.
#[derive(Debug, Clone, PartialEq)]
pub enum What {
    /// The first record of every file.
    FileVersion,
    /// Tagged values.
    Summary(Vec<(String, Value)>),
    /// A `SessionLog` START: TensorBoard drops the earlier data at and after this step.
    Start,
}

/// An event, as written.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub wall_time: f64,
    pub step: i64,
    pub what: What,
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, (u64::from(field) << 3) | u64::from(wire));
}

fn bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    key(out, field, 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// `Summary.Value` of a string tensor shown by the text plugin.
fn text_value(out: &mut Vec<u8>, text: &str) {
    let mut plugin = Vec::new();
    bytes_field(&mut plugin, 1, b"text");
    let mut metadata = Vec::new();
    bytes_field(&mut metadata, 1, &plugin);
    // TensorProto: dtype DT_STRING (7), an empty shape (a scalar), the string.
    let mut tensor = Vec::new();
    key(&mut tensor, 1, 0);
    varint(&mut tensor, 7);
    bytes_field(&mut tensor, 2, &[]);
    bytes_field(&mut tensor, 8, text.as_bytes());
    bytes_field(out, 9, &metadata);
    bytes_field(out, 8, &tensor);
}

impl Event {
    /// The event's protocol buffer.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        key(&mut out, 1, 1);
        out.extend_from_slice(&self.wall_time.to_le_bytes());
        key(&mut out, 2, 0);
        varint(&mut out, self.step as u64);
        match &self.what {
            What::FileVersion => bytes_field(&mut out, 3, FILE_VERSION.as_bytes()),
            What::Summary(values) => {
                let mut summary = Vec::new();
                for (tag, value) in values {
                    let mut v = Vec::new();
                    bytes_field(&mut v, 1, tag.as_bytes());
                    match value {
                        Value::Scalar(x) => {
                            key(&mut v, 2, 5);
                            v.extend_from_slice(&x.to_le_bytes());
                        }
                        Value::Text(text) => text_value(&mut v, text),
                    }
                    bytes_field(&mut summary, 1, &v);
                }
                bytes_field(&mut out, 5, &summary);
            }
            What::Start => {
                let mut log = Vec::new();
                key(&mut log, 1, 0);
                varint(&mut log, 1);
                bytes_field(&mut out, 7, &log);
            }
        }
        out
    }
}

// ------------------------------------------------------------------------------------------------
// Decoding

/// What an event read back is: enough to tell which of the writer's own records it is.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    FileVersion(String),
    /// A summary, with the tags of its values in order.
    Summary(Vec<String>),
    /// A `SessionLog` with this status (1: START).
    SessionLog(u64),
    /// Anything else (a graph, run metadata, an empty event).
    Other,
}

/// An event's time, step and kind.
#[derive(Debug, Clone, PartialEq)]
pub struct EventHead {
    pub wall_time: f64,
    pub step: i64,
    pub kind: Kind,
}

/// A protocol buffer's fields, read one at a time.
struct Fields<'a>(&'a [u8]);

enum Field<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Bytes(&'a [u8]),
    Fixed32,
}

fn malformed(what: &'static str) -> FormatError {
    FormatError::Malformed(what)
}

impl<'a> Fields<'a> {
    fn varint(&mut self) -> Result<u64, FormatError> {
        let mut v = 0u64;
        for i in 0..10 {
            let (&b, rest) = self
                .0
                .split_first()
                .ok_or(malformed("a truncated varint"))?;
            self.0 = rest;
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(malformed("a varint over 10 bytes"))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        if self.0.len() < n {
            return Err(malformed("a field longer than its message"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn next(&mut self) -> Option<Result<(u64, Field<'a>), FormatError>> {
        if self.0.is_empty() {
            return None;
        }
        Some((|| {
            let k = self.varint()?;
            let field = match k & 7 {
                0 => Field::Varint(self.varint()?),
                1 => Field::Fixed64(self.take(8)?.try_into().unwrap()),
                2 => {
                    let len = self.varint()?;
                    let len = usize::try_from(len).map_err(|_| malformed("a huge length"))?;
                    Field::Bytes(self.take(len)?)
                }
                5 => {
                    self.take(4)?;
                    Field::Fixed32
                }
                _ => return Err(malformed("an unknown wire type")),
            };
            Ok((k >> 3, field))
        })())
    }
}

/// The head of the `Event` in a record's data.
pub fn decode(data: &[u8]) -> Result<EventHead, FormatError> {
    let mut head = EventHead {
        wall_time: 0.0,
        step: 0,
        kind: Kind::Other,
    };
    let mut fields = Fields(data);
    while let Some(field) = fields.next() {
        match field? {
            (1, Field::Fixed64(b)) => head.wall_time = f64::from_le_bytes(b),
            (2, Field::Varint(v)) => head.step = v as i64,
            (3, Field::Bytes(b)) => {
                head.kind = Kind::FileVersion(String::from_utf8_lossy(b).into_owned())
            }
            (5, Field::Bytes(b)) => head.kind = Kind::Summary(summary_tags(b)?),
            (7, Field::Bytes(b)) => {
                let mut status = 0;
                let mut log = Fields(b);
                while let Some(field) = log.next() {
                    if let (1, Field::Varint(v)) = field? {
                        status = v;
                    }
                }
                head.kind = Kind::SessionLog(status);
            }
            _ => {}
        }
    }
    Ok(head)
}

/// The tags of a `Summary`'s values.
fn summary_tags(summary: &[u8]) -> Result<Vec<String>, FormatError> {
    let mut tags = Vec::new();
    let mut fields = Fields(summary);
    while let Some(field) = fields.next() {
        if let (1, Field::Bytes(value)) = field? {
            let mut value = Fields(value);
            while let Some(field) = value.next() {
                if let (1, Field::Bytes(tag)) = field? {
                    tags.push(String::from_utf8_lossy(tag).into_owned());
                }
            }
        }
    }
    Ok(tags)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The check value of CRC-32C (the catalogue's "123456789"), and a vector of RFC 3720's
    /// (iSCSI) appendix B.4: 32 bytes of zeros.
    #[test]
    fn crc32c_matches_its_published_check_values() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
        assert_eq!(crc32c(b""), 0);
    }

    /// The mask, worked by hand for the check value 0xE3069283: rotated right by 15 it is
    /// 0x2507C60D, plus 0xA282EAD8 (mod 2^32) 0xC78AB0E5.
    #[test]
    fn the_mask_rotates_and_adds() {
        assert_eq!(masked_crc(b"123456789"), 0xC78A_B0E5);
    }

    #[test]
    fn records_round_trip_and_a_torn_tail_is_left_out() {
        let mut file = record(b"first");
        file.extend(record(b""));
        file.extend(record(&[7u8; 300]));
        let (got, torn) = records(&file).unwrap();
        assert_eq!(got, [&b"first"[..], b"", &[7u8; 300][..]]);
        assert!(!torn);
        for cut in [1, 11, 12, 20, file.len() - 1] {
            let (got, torn) = records(&file[..file.len() - cut]).unwrap();
            assert!(torn, "cut {cut}");
            assert!(got.len() < 3, "cut {cut}");
        }
    }

    #[test]
    fn a_corrupt_record_is_an_error_naming_its_offset() {
        let mut file = record(b"first");
        let second = file.len();
        file.extend(record(b"second"));
        let mut bad = file.clone();
        bad[second + 14] ^= 1;
        assert_eq!(records(&bad), Err(FormatError::DataChecksum(second)));
        let mut bad = file.clone();
        bad[second] ^= 1;
        assert_eq!(records(&bad), Err(FormatError::LengthChecksum(second)));
        // A length over the bound with a valid checksum is refused before anything is read.
        let len = (MAX_RECORD + 1).to_le_bytes();
        let mut huge = len.to_vec();
        huge.extend(masked_crc(&len).to_le_bytes());
        assert_eq!(records(&huge), Err(FormatError::TooLong(0, MAX_RECORD + 1)));
    }

    #[test]
    fn events_decode_to_what_was_encoded() {
        let cases = [
            (What::FileVersion, Kind::FileVersion(FILE_VERSION.into())),
            (
                What::Summary(vec![
                    ("diffmon/icr".into(), Value::Scalar(0.25)),
                    (
                        "diffmon/early_stop/text".into(),
                        Value::Text("fired".into()),
                    ),
                ]),
                Kind::Summary(vec!["diffmon/icr".into(), "diffmon/early_stop/text".into()]),
            ),
            (What::Start, Kind::SessionLog(1)),
        ];
        for (what, kind) in cases {
            let event = Event {
                wall_time: 1_700_000_000.123_456,
                step: -5,
                what,
            };
            let head = decode(&event.encode()).unwrap();
            assert_eq!(head.wall_time, event.wall_time);
            assert_eq!(head.step, -5);
            assert_eq!(head.kind, kind);
        }
    }

    /// A scalar's bytes, written out by hand from the protocol buffers' encoding rules.
    #[test]
    fn a_scalar_event_has_the_bytes_of_the_protocol() {
        let event = Event {
            wall_time: 2.0,
            step: 300,
            what: What::Summary(vec![("a".into(), Value::Scalar(1.5))]),
        };
        let mut want = vec![0x09];
        want.extend(2.0f64.to_le_bytes());
        want.extend([0x10, 0xac, 0x02]); // step 300 as a varint
        // summary (5): value (1) { tag (1) "a", simple_value (2, fixed32) 1.5 }
        want.extend([0x2a, 10, 0x0a, 8, 0x0a, 1, b'a', 0x15]);
        want.extend(1.5f32.to_le_bytes());
        assert_eq!(event.encode(), want);
    }

    #[test]
    fn malformed_protocol_buffers_are_errors_not_panics() {
        for bad in [
            &[0x09, 1, 2][..],
            &[
                0x10, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
            ],
            &[0x2a, 0x7f, 0],
            &[0x0b],
            &[0x2a, 2, 0x0a, 9],
        ] {
            assert!(decode(bad).is_err(), "{bad:?}");
        }
    }
}
