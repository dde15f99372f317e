//! A JSON value kept as its text.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;

/// A JSON value kept as its text (a harness body, a tool's parameter schema): written out as
/// it is (no tree built, no re-serialization), read back without parsing what is inside.
///
/// Never holds a line break: a record is one line of NDJSON, and in valid JSON a raw CR or LF
/// can only be whitespace between tokens (inside a string it is escaped), so each becomes a
/// space and the value is unchanged, whether the body came from a harness or from a record
/// someone pretty-printed.
#[derive(Debug, Clone, Serialize)]
#[serde(transparent)]
pub struct RawJson(Box<RawValue>);

impl RawJson {
    /// `json`, which must be one valid JSON value (checked).
    pub fn from_json(json: String) -> Result<RawJson, serde_json::Error> {
        RawValue::from_string(json).map(RawJson::on_one_line)
    }

    fn on_one_line(raw: Box<RawValue>) -> RawJson {
        if memchr::memchr2(b'\n', b'\r', raw.get().as_bytes()).is_none() {
            return RawJson(raw);
        }
        let one_line = raw.get().replace(['\n', '\r'], " ");
        RawJson(
            RawValue::from_string(one_line).expect("whitespace for whitespace keeps JSON valid"),
        )
    }

    /// A JSON value, serialized.
    pub fn from_value(v: &Value) -> RawJson {
        RawJson(serde_json::value::to_raw_value(v).expect("a JSON value always serializes"))
    }

    /// `value` serialized (not parsed again: serde_json writes valid JSON).
    pub fn of<T: Serialize + ?Sized>(value: &T) -> RawJson {
        let raw = serde_json::value::to_raw_value(value).expect("the value serializes to JSON");
        RawJson::on_one_line(raw)
    }

    /// The JSON text.
    pub fn get(&self) -> &str {
        self.0.get()
    }

    /// The value parsed (for tests and tools; the hot paths never build this tree). Panics on
    /// a number a `Value` cannot hold (`1e400`): valid JSON, so a RawJson may carry one.
    pub fn to_value(&self) -> Value {
        serde_json::from_str(self.get()).expect("a RawJson holds JSON a Value can hold")
    }
}

impl<'de> Deserialize<'de> for RawJson {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<RawJson, D::Error> {
        Box::<RawValue>::deserialize(d).map(RawJson::on_one_line)
    }
}

/// The same JSON value: the same text (the usual case, and cheap), or text that differs only
/// in layout. Text holding a number a `Value` cannot (`1e400`, valid JSON) is equal only to
/// the same text.
impl PartialEq for RawJson {
    fn eq(&self, other: &Self) -> bool {
        if self.get() == other.get() {
            return true;
        }
        let parse = |r: &RawJson| serde_json::from_str::<Value>(r.get()).ok();
        matches!((parse(self), parse(other)), (Some(a), Some(b)) if a == b)
    }
}

impl JsonSchema for RawJson {
    fn schema_name() -> String {
        "RawJson".into()
    }

    fn json_schema(gen: &mut schemars::gen::SchemaGenerator) -> schemars::schema::Schema {
        Value::json_schema(gen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_by_value_and_never_a_panic_on_a_number_a_value_cannot_hold() {
        let a = RawJson::from_json(r#"{"a": [1, 2]}"#.into()).unwrap();
        let b = RawJson::from_json(r#"{"a":[1,2]}"#.into()).unwrap();
        assert_eq!(a, b);
        // Valid JSON (kept as text), but no f64 holds it.
        let huge = RawJson::from_json(r#"{"max": 1e400}"#.into()).unwrap();
        assert_eq!(huge, huge.clone());
        assert_ne!(huge, RawJson::from_json(r#"{"max":1e400}"#.into()).unwrap());
        assert_ne!(huge, a);
    }
}
