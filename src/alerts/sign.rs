//! Standard-Webhooks signing (<https://www.standardwebhooks.com/>): `webhook-id`,
//! `webhook-timestamp` and `webhook-signature: v1,<base64 HMAC-SHA256(key, "{id}.{ts}.{body}")>`.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;

/// A signing secret read from the environment. Its `Debug` prints `***`; it has no `Display`,
/// and is never logged or put into an error.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: String) -> Secret {
        Secret(value)
    }

    /// The HMAC key. A secret in the Standard-Webhooks form `whsec_<base64>` is base64-decoded
    /// (what the Standard-Webhooks libraries do); any other value is used as its UTF-8 bytes.
    fn key(&self) -> Vec<u8> {
        if let Some(b64) = self.0.strip_prefix("whsec_")
            && let Ok(bytes) = STANDARD.decode(b64)
            && !bytes.is_empty()
        {
            return bytes;
        }
        self.0.as_bytes().to_vec()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// The `webhook-signature` header value: `v1,<base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}"))>`.
pub fn signature(secret: &Secret, id: &str, timestamp: i64, body: &[u8]) -> String {
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(&secret.key()) else {
        unreachable!("HMAC accepts keys of any length")
    };
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_secret_vector() {
        // Computed once with Python:
        //   "v1," + base64.b64encode(hmac.new(b"diffmon-test-secret",
        //       b'evt_1.1700000000.{"a":1}', hashlib.sha256).digest()).decode()
        let s = Secret::new("diffmon-test-secret".into());
        assert_eq!(
            signature(&s, "evt_1", 1_700_000_000, br#"{"a":1}"#),
            "v1,UFX3tSiVjVNGGgVuWBuRxX8hvwhdjvf8NBQshEf/pqI="
        );
    }

    #[test]
    fn whsec_secret_is_base64_decoded() {
        // Python: key = b"0123456789abcdef0123456789abcdef";
        //   secret = "whsec_" + base64.b64encode(key).decode()
        //   "v1," + base64.b64encode(hmac.new(key, b'msg_p5jXN8AQM9LWM0D4loKWxJek.1614265330.'
        //       b'{"test": 2432232314}', hashlib.sha256).digest()).decode()
        let s = Secret::new("whsec_MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=".into());
        assert_eq!(
            signature(
                &s,
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1_614_265_330,
                br#"{"test": 2432232314}"#
            ),
            "v1,hK4CWvngkaAwjY1pABLuUbOIkEJjW9tAapq1no4ojG0="
        );
    }

    #[test]
    fn debug_hides_the_value() {
        let s = Secret::new("hunter2-very-secret".into());
        assert_eq!(format!("{s:?}"), "***");
        assert_eq!(format!("{:?}", Some(s)), "Some(***)");
    }
}
