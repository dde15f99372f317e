//! Secrets never reach a record: credentials in headers, query strings and well-known body
//! fields are replaced by a marker before anything is stored.

use std::collections::BTreeMap;

use serde_json::Value;

pub const REDACTED: &str = "[redacted]";

const SECRET_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "x-goog-api-key",
    "cookie",
    "set-cookie",
];

/// Whether a header, query parameter or body field name looks like it carries a credential:
/// a known header, or a name with a word such as `key` or `token` (`x-api-key`,
/// `access_token`), matched by word so `x-tokentap-session` and `max_tokens` are not.
fn is_secret_name(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    SECRET_HEADERS.contains(&n.as_str())
        || n.split(['-', '_', '.']).any(|w| {
            matches!(
                w,
                "key"
                    | "apikey"
                    | "token"
                    | "secret"
                    | "password"
                    | "passwd"
                    | "credential"
                    | "credentials"
                    | "signature"
                    | "sig"
                    | "auth"
                    | "authorization"
                    | "cookie"
            )
        })
}

/// Headers with lower-case names and credentials redacted.
pub fn headers<'a>(pairs: impl Iterator<Item = (&'a str, &'a [u8])>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (name, value) in pairs {
        let name = name.to_ascii_lowercase();
        let value = if is_secret_name(&name) {
            REDACTED.to_owned()
        } else {
            String::from_utf8_lossy(value).into_owned()
        };
        // Repeated headers are joined as HTTP allows.
        out.entry(name)
            .and_modify(|v: &mut String| {
                v.push_str(", ");
                v.push_str(&value)
            })
            .or_insert(value);
    }
    out
}

/// A query string with credential-looking parameter values redacted.
pub fn query(q: &str) -> String {
    q.split('&')
        .map(|pair| match pair.split_once('=') {
            Some((k, _)) if is_secret_name(k) => format!("{k}={REDACTED}"),
            _ => pair.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// Redacts string-valued credential fields at the top level of a JSON request body (e.g.
/// `api_key`; numeric fields such as `max_tokens` are not credentials).
/// Deeper fields are content (tool schemas, messages) and are kept as the model saw them.
pub fn body(mut v: Value) -> Value {
    if let Some(obj) = v.as_object_mut() {
        for (k, val) in obj.iter_mut() {
            if is_secret_name(k) && val.is_string() {
                *val = Value::String(REDACTED.into());
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn credential_headers_are_redacted_and_others_kept() {
        let h = headers(
            [
                ("Authorization", b"Bearer sk-live".as_slice()),
                ("X-Api-Key", b"abc"),
                ("Cookie", b"s=1"),
                ("Content-Type", b"application/json"),
                ("x-tokentap-session", b"s1"),
            ]
            .into_iter(),
        );
        assert_eq!(h["authorization"], REDACTED);
        assert_eq!(h["x-api-key"], REDACTED);
        assert_eq!(h["cookie"], REDACTED);
        assert_eq!(h["content-type"], "application/json");
        assert_eq!(h["x-tokentap-session"], "s1");
        assert!(!format!("{h:?}").contains("sk-live"));
    }

    #[test]
    fn query_keys_are_redacted() {
        assert_eq!(
            query("session=a&api_key=sk-1&key=x&beta=true"),
            "session=a&api_key=[redacted]&key=[redacted]&beta=true"
        );
    }

    #[test]
    fn body_credentials_are_redacted_but_token_limits_kept() {
        let b = body(
            json!({"api_key": "sk-1", "max_tokens": 5, "max_completion_tokens": 7, "model": "m"}),
        );
        assert_eq!(
            b,
            json!({"api_key": REDACTED, "max_tokens": 5, "max_completion_tokens": 7, "model": "m"})
        );
    }
}
