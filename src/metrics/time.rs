//! Times as the metrics need them: now, and an RFC 3339 time from the history, in seconds since
//! the Unix epoch.

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch now.
pub(super) fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Seconds since the Unix epoch of an RFC 3339 time in UTC as the history writes it
/// (`2023-11-14T22:13:20.123Z`, fraction optional); None if it is not one.
pub fn parse_rfc3339_utc(s: &str) -> Option<f64> {
    let b = s.as_bytes();
    if b.len() < 20
        || b[4] != b'-'
        || b[7] != b'-'
        || b[10] != b'T'
        || b[13] != b':'
        || b[16] != b':'
    {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let t = s.get(r)?;
        if t.bytes().all(|c| c.is_ascii_digit()) {
            t.parse().ok()
        } else {
            None
        }
    };
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let rest = s.get(19..)?;
    let frac = match rest.strip_suffix('Z')? {
        "" => 0.0,
        f => {
            let digits = f.strip_prefix('.')?;
            if digits.is_empty() || digits.len() > 9 || !digits.bytes().all(|c| c.is_ascii_digit())
            {
                return None;
            }
            format!("0.{digits}").parse::<f64>().ok()?
        }
    };
    // Days from civil (H. Hinnant).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86_400 + h * 3600 + mi * 60 + sec) as f64 + frac)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_times_parse_back() {
        use std::time::{Duration, UNIX_EPOCH};
        for secs in [0u64, 951_782_400, 1_700_000_000, 4_102_444_800 + 86_399] {
            for ms in [0u64, 1, 999] {
                let t = UNIX_EPOCH + Duration::from_millis(secs * 1000 + ms);
                let s = crate::record::rfc3339_utc(t);
                let back = parse_rfc3339_utc(&s).unwrap();
                assert!(
                    (back - (secs as f64 + ms as f64 / 1000.0)).abs() < 1e-6,
                    "{s}"
                );
            }
        }
        for bad in [
            "",
            "2023-11-14 22:13:20Z",
            "2023-13-14T22:13:20Z",
            "2023-11-14T22:13:20",
            "2023-11-14T22:13:20.Z",
            "2023-11-14T22:13:20.1234567890Z",
            "２023-11-14T22:13:20Z",
        ] {
            assert_eq!(parse_rfc3339_utc(bad), None, "{bad}");
        }
    }
}
