//! A harness request body parsed into a wire module's request type, with the errors every
//! provider API reports the same way: not JSON, not an object, or a field's path and fault.

use serde::Deserialize;
use serde_json::Value;

use super::WireError;

/// Parses JSON text into `T`, naming the failing field path in the error.
///
/// One pass straight from the bytes: no `Value` tree of the whole body first (it cost more
/// than the typed parse itself on a 40 KB agent request). The errors stay those of the
/// two-step parse: a syntax error anywhere wins over a field's wrong type, and a field's error
/// is the one the `Value` path gives (reading bytes, serde_json reports some type errors as
/// syntax: an enum given a number is "expected value"). Both are worked out only on the error
/// path.
pub(crate) fn parse_json_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, WireError> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(match syntax_error(body) {
            Some(e) => not_json(e),
            None => WireError::new("Request body must be a JSON object."),
        });
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    match serde_path_to_error::deserialize(&mut de) {
        Ok(v) => de.end().map(|()| v).map_err(not_json),
        Err(direct) => {
            if let Some(syntax) = syntax_error(body) {
                return Err(not_json(syntax));
            }
            match serde_json::from_slice::<Value>(body).map(serde_path_to_error::deserialize) {
                // The `Value` path takes what the bytes refuse: a repeated key, the last one
                // counting (rare enough to parse twice).
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => {
                    let path = e.path().to_string();
                    Err(field_error(path, e.into_inner().to_string()))
                }
                Err(_) => {
                    let path = direct.path().to_string();
                    Err(field_error(path, without_position(direct.into_inner())))
                }
            }
        }
    }
}

fn field_error(path: String, inner: String) -> WireError {
    if path == "." {
        WireError::new(format!("Invalid request: {inner}"))
    } else {
        WireError::at(path.clone(), format!("Invalid value for '{path}': {inner}"))
    }
}

/// The first syntax error in `body`, if it is not one JSON value (a scan that builds nothing;
/// run only on the error path).
fn syntax_error(body: &[u8]) -> Option<serde_json::Error> {
    serde_json::from_slice::<serde::de::IgnoredAny>(body).err()
}

fn not_json(e: serde_json::Error) -> WireError {
    WireError::new(format!("Request body is not valid JSON: {e}"))
}

/// A data error's message without the " at line L column C" serde_json adds when it parses
/// from bytes: the path says where.
fn without_position(e: serde_json::Error) -> String {
    let text = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    match text.strip_suffix(&suffix) {
        Some(message) => message.to_owned(),
        None => text,
    }
}

/// Content as the chat APIs send it: a plain string, or a list of typed items (Chat
/// Completions' parts, Messages' blocks).
///
/// Read by the JSON type, not `#[serde(untagged)]`: an untagged enum buffers the whole value
/// (a system prompt of tens of KB) and copies its strings again to try each variant; and a bad
/// item is named by its own path rather than "did not match any variant".
pub(crate) enum TextOrList<T> {
    Text(String),
    List(Vec<T>),
}

/// What content made of `Self` items is called in an error: "a string or an array of …".
pub(crate) trait ListItem {
    const CONTENT_EXPECTING: &'static str;
}

impl<'de, T: Deserialize<'de> + ListItem> Deserialize<'de> for TextOrList<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ContentVisitor<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de> + ListItem> serde::de::Visitor<'de> for ContentVisitor<T> {
            type Value = TextOrList<T>;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(T::CONTENT_EXPECTING)
            }

            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<TextOrList<T>, E> {
                Ok(TextOrList::Text(s.to_owned()))
            }

            fn visit_string<E: serde::de::Error>(self, s: String) -> Result<TextOrList<T>, E> {
                Ok(TextOrList::Text(s))
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                seq: A,
            ) -> Result<TextOrList<T>, A::Error> {
                Deserialize::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))
                    .map(TextOrList::List)
            }
        }
        d.deserialize_any(ContentVisitor(std::marker::PhantomData))
    }
}
