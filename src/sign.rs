//! Standard-Webhooks signing (<https://www.standardwebhooks.com/>): `webhook-id`,
//! `webhook-timestamp` and `webhook-signature: v1,<base64 HMAC-SHA256(key, "{id}.{ts}.{body}")>`.

use base64::Engine;
use base64::alphabet::STANDARD as ALPHABET;
use base64::engine::general_purpose::STANDARD;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;

/// How the official Standard-Webhooks libraries decode a secret: standard alphabet, padding
/// optional, trailing bits ignored (Python's `base64.b64decode(s + "==")`).
const LENIENT: GeneralPurpose = GeneralPurpose::new(
    &ALPHABET,
    GeneralPurposeConfig::new()
        .with_decode_padding_mode(DecodePaddingMode::RequireNone)
        .with_decode_allow_trailing_bits(true),
);

/// Why a secret's value was refused. Never holds the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    #[error("is empty")]
    Empty,
    #[error(
        "is not base64 (character {position} is not one of A-Z a-z 0-9 + /); a Standard-Webhooks \
         secret is `whsec_` followed by base64 of the key bytes"
    )]
    NotBase64 { position: usize },
    #[error(
        "is not base64 (its length, {len} characters without padding, is 1 more than a multiple of 4)"
    )]
    BadLength { len: usize },
}

/// A signing secret read from the environment: the HMAC key bytes. Its `Debug` prints `***`; it
/// has no `Display`, and is never logged or put into an error.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// Decodes a secret as the official `standardwebhooks` library does: an optional `whsec_`
    /// prefix, then base64 of the key in the standard alphabet, padded or not. Anything else is
    /// refused: the library would silently drop characters outside the alphabet (`-`, `_`, `.`,
    /// whitespace), so the receiver's key would not be what the sender meant.
    pub fn parse(value: &str) -> Result<Secret, SecretError> {
        let text = value.strip_prefix("whsec_").unwrap_or(value);
        let body = text.trim_end_matches('=');
        if let Some((position, _)) = body
            .char_indices()
            .find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '+' || *c == '/'))
        {
            return Err(SecretError::NotBase64 {
                position: position + 1,
            });
        }
        if body.len() % 4 == 1 {
            return Err(SecretError::BadLength { len: body.len() });
        }
        let key = LENIENT
            .decode(body)
            .map_err(|_| SecretError::BadLength { len: body.len() })?;
        if key.is_empty() {
            return Err(SecretError::Empty);
        }
        Ok(Secret(key))
    }
}

impl Secret {
    /// A key for another use, derived from this secret: HMAC-SHA256(secret, `context`). The
    /// outbox authenticates its entries for a signed destination with it, so that an entry that
    /// gets delivered with a valid signature cannot be made without the secret.
    pub fn derive(&self, context: &[u8]) -> [u8; 32] {
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(&self.0) else {
            unreachable!("HMAC accepts keys of any length")
        };
        mac.update(context);
        mac.finalize().into_bytes().into()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// The `webhook-signature` header value: `v1,<base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}"))>`.
pub fn signature(secret: &Secret, id: &str, timestamp: i64, body: &[u8]) -> String {
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(&secret.0) else {
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

    /// Vectors computed with the official Python library (`standardwebhooks` 1.1.0):
    ///   Webhook(secret).sign("msg_p5jXN8AQM9LWM0D4loKWxJek",
    ///       datetime.fromtimestamp(1614265330, timezone.utc), '{"test": 2432232314}')
    /// for the key b"0123456789abcdef0123456789abcdef" written in each form it accepts.
    #[test]
    fn every_form_the_official_library_accepts_gives_its_signature() {
        for form in [
            "whsec_MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=",
            "whsec_MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY",
            "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=",
            "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY",
        ] {
            let s = Secret::parse(form).unwrap();
            assert_eq!(
                signature(
                    &s,
                    "msg_p5jXN8AQM9LWM0D4loKWxJek",
                    1_614_265_330,
                    br#"{"test": 2432232314}"#
                ),
                "v1,hK4CWvngkaAwjY1pABLuUbOIkEJjW9tAapq1no4ojG0=",
                "{form}"
            );
        }
        // Unpadded with trailing bits (`c2hvcnQ` is b"short"), same library.
        assert_eq!(
            signature(
                &Secret::parse("whsec_c2hvcnQ").unwrap(),
                "msg_p5jXN8AQM9LWM0D4loKWxJek",
                1_614_265_330,
                br#"{"test": 2432232314}"#
            ),
            "v1,LW3X+soxXFm2hXHnDs/ujwnGH2iwvif3U1hdRBIY/VY="
        );
    }

    /// What the library refuses, and what it would silently mangle (it drops `-`, `_` and
    /// whitespace before decoding), is refused with the reason and never the value.
    #[test]
    fn anything_else_is_refused_without_showing_it() {
        for (value, want) in [
            ("whsec_", SecretError::Empty),
            ("", SecretError::Empty),
            ("whsec_a", SecretError::BadLength { len: 1 }),
            (
                "hunter2-very-secret",
                SecretError::NotBase64 { position: 8 },
            ),
            ("abc_def", SecretError::NotBase64 { position: 4 }),
            (" whsec_MDEy", SecretError::NotBase64 { position: 1 }),
            ("whsec_MDEy\n", SecretError::NotBase64 { position: 5 }),
            ("ab=c", SecretError::NotBase64 { position: 3 }),
        ] {
            let err = Secret::parse(value).err();
            assert_eq!(err.as_ref(), Some(&want), "{value:?}");
            let text = err.unwrap().to_string();
            assert!(value.len() < 4 || !text.contains(value), "{text}");
        }
    }

    #[test]
    fn debug_hides_the_value() {
        let s = Secret::parse("aHVudGVyMi12ZXJ5LXNlY3JldA").unwrap();
        assert_eq!(format!("{s:?}"), "***");
        assert_eq!(format!("{:?}", Some(s)), "Some(***)");
    }
}
