//! tokentap's wire formats as data: the capture record written for every model call, the
//! canonical chat request it contains, the trajectories rebuilt from records, the
//! proxy-to-worker shipping protocol, NDJSON framing, and JSON Schema export for consumers
//! outside Rust. No I/O, no async.

pub mod chat;
pub mod compact;
pub mod ndjson;
pub mod raw_json;
pub mod record;
pub mod ship;
pub mod token_mode;
pub mod trajectory;

pub use chat::*;
pub use raw_json::RawJson;
pub use record::*;
pub use token_mode::*;
pub use trajectory::*;

/// The JSON Schema (draft 07) of [`CaptureRecord`], for consumers outside Rust.
pub fn capture_record_json_schema() -> serde_json::Value {
    let schema = schemars::schema_for!(CaptureRecord);
    serde_json::to_value(schema).expect("a schema always serializes")
}

/// The JSON Schema (draft 07) of a [`Trace`] (one row of `traces.jsonl`).
pub fn trace_json_schema() -> serde_json::Value {
    let schema = schemars::schema_for!(Trace);
    serde_json::to_value(schema).expect("a schema always serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The committed schema file must match the types; regenerate with
    /// `tokentap schema > capture-schema/capture-record.schema.json`.
    #[test]
    fn committed_json_schema_is_current() {
        let committed: serde_json::Value =
            serde_json::from_str(include_str!("../capture-record.schema.json")).unwrap();
        assert_eq!(
            committed,
            capture_record_json_schema(),
            "capture-record.schema.json is stale: run `tokentap schema > capture-schema/capture-record.schema.json`"
        );
    }

    /// Likewise for a trace row: `tokentap schema --trace > capture-schema/trace.schema.json`.
    #[test]
    fn committed_trace_schema_is_current() {
        let committed: serde_json::Value =
            serde_json::from_str(include_str!("../trace.schema.json")).unwrap();
        assert_eq!(
            committed,
            trace_json_schema(),
            "trace.schema.json is stale: run `tokentap schema --trace > capture-schema/trace.schema.json`"
        );
    }
}
