//! The control plane's OpenAPI 3.0 document, served at `/openapi.json`. Paths are written
//! here next to the router they describe; every body's schema is generated from the Rust
//! types the handlers (de)serialize, so the two cannot drift apart.

use schemars::gen::SchemaSettings;
use schemars::JsonSchema;
use serde_json::{json, Map, Value};

use crate::cluster::ClusterGateStatus;
use crate::evaluate::Evaluation;
use crate::gate::GateStatus;
use crate::pipeline::Event;
use crate::task::{Rollout, Sample, TaskSpec};

/// The routes the document describes, as (method, path): the router's, without `/health`,
/// `/metrics` and `/openapi.json` itself.
pub const ROUTES: &[(&str, &str)] = &[
    ("post", "/v1/rollouts"),
    ("get", "/v1/rollouts/{id}"),
    ("delete", "/v1/rollouts/{id}"),
    ("get", "/v1/rollouts/{id}/events"),
    ("get", "/v1/samples/{id}/traces"),
    ("get", "/v1/results"),
    ("post", "/v1/admin/pause"),
    ("post", "/v1/admin/resume"),
    ("get", "/v1/admin/status"),
];

/// In OpenAPI 3.0 a `$ref` replaces its whole object: keywords beside it (schemars puts
/// `nullable`, `description` and `default` there for an `Option` of a named type) are ignored,
/// so `null` — e.g. a running sample's `outcome` — would not validate. Such an object becomes
/// `{"allOf": [{"$ref": …}], …}`, where the keywords count.
fn keep_keywords_beside_refs(v: &mut Value) {
    match v {
        Value::Object(o) => {
            if o.len() > 1 {
                if let Some(r) = o.remove("$ref") {
                    o.insert("allOf".into(), json!([{ "$ref": r }]));
                }
            }
            o.values_mut().for_each(keep_keywords_beside_refs);
        }
        Value::Array(a) => a.iter_mut().for_each(keep_keywords_beside_refs),
        _ => {}
    }
}

pub fn document() -> Value {
    let mut gen = SchemaSettings::openapi3().into_generator();
    let of = |name: &str| json!({"$ref": format!("#/components/schemas/{name}")});
    // Registers each type (and everything it refers to) under components/schemas.
    fn add<T: JsonSchema>(gen: &mut schemars::gen::SchemaGenerator) {
        let _ = gen.subschema_for::<T>();
    }
    add::<TaskSpec>(&mut gen);
    add::<Rollout>(&mut gen);
    add::<Sample>(&mut gen);
    add::<Evaluation>(&mut gen);
    add::<GateStatus>(&mut gen);
    add::<ClusterGateStatus>(&mut gen);
    add::<Event>(&mut gen);
    let mut schemas: Map<String, Value> = gen
        .take_definitions()
        .into_iter()
        .map(|(k, v)| (k, serde_json::to_value(v).unwrap_or(Value::Null)))
        .collect();
    schemas.insert(
        "Error".into(),
        json!({
            "type": "object",
            "required": ["error"],
            "properties": {"error": {"type": "object", "required": ["type", "message"], "properties": {
                "type": {"type": "string"}, "message": {"type": "string"}}}}
        }),
    );
    let err = |what: &str| json!({"description": what, "content": {"application/json": {"schema": of("Error")}}});
    let ok = |what: &str, body: Value| json!({"description": what, "content": {"application/json": {"schema": body}}});
    // A node of a cluster (`serve --bus`) answers for the cluster: every live node's part too.
    let gate = || json!({"oneOf": [of("GateStatus"), of("ClusterGateStatus")]});
    let id = json!([{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}]);
    let paths = json!({
        "/v1/rollouts": {"post": {
            "summary": "Submit a task: num_samples samples (one GRPO group); returns at once",
            "operationId": "submitRollout",
            "requestBody": {"required": true, "content": {"application/json": {"schema": of("TaskSpec")}}},
            "responses": {
                "202": ok("Accepted", json!({"type": "object", "required": ["rollout_id", "samples"], "properties": {
                    "rollout_id": {"type": "string"}, "samples": {"type": "array", "items": {"type": "string"}}}})),
                "400": err("The task is invalid (the message says which field)"),
                "401": err("Missing or wrong bearer token")
            }
        }},
        "/v1/rollouts/{id}": {
            "get": {
                "summary": "A rollout, its samples and their status",
                "operationId": "getRollout",
                "parameters": id,
                "responses": {
                    "200": ok("The rollout", json!({"type": "object", "properties": {
                        "rollout": of("Rollout"),
                        "status": {"type": "string", "enum": ["running", "done"]},
                        "samples": {"type": "array", "items": of("Sample")}}})),
                    "404": err("No such rollout")
                }
            },
            "delete": {
                "summary": "Cancel: queued samples end now, running agents are killed",
                "operationId": "cancelRollout",
                "parameters": id,
                "responses": {
                    "200": ok("Cancelled", json!({"type": "object", "properties": {
                        "rollout_id": {"type": "string"}, "stopping": {"type": "integer"}}})),
                    "404": err("No such rollout")
                }
            }
        },
        "/v1/rollouts/{id}/events": {"get": {
            "summary": "Progress as server-sent events: snapshot, stage, finished, done (then the stream ends)",
            "operationId": "rolloutEvents",
            "parameters": id,
            "responses": {
                "200": {"description": "text/event-stream; `stage` and `finished` data are Event objects, `snapshot` data is the rollout with its samples",
                    "content": {"text/event-stream": {"schema": of("Event")}}},
                "404": err("No such rollout")
            }
        }},
        "/v1/samples/{id}/traces": {"get": {
            "summary": "A finished sample's trace rows (JSON Lines; the trace schema is `tokentap schema --trace`)",
            "operationId": "sampleTraces",
            "parameters": id,
            "responses": {
                "200": {"description": "One trace per line", "content": {"application/jsonl": {"schema": {"type": "string"}}}},
                "404": err("No such sample, or it has no trajectory yet")
            }
        }},
        "/v1/results": {"get": {
            "summary": "Finished samples after a cursor, oldest first; long-polls when there are none",
            "operationId": "results",
            "parameters": [
                {"name": "after", "in": "query", "schema": {"type": "integer", "minimum": 0, "default": 0}},
                {"name": "wait", "in": "query", "description": "seconds to wait for a result (at most 60)", "schema": {"type": "integer", "minimum": 0, "default": 0}},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}}
            ],
            "responses": {"200": ok("A page of results", json!({"type": "object", "required": ["results", "next"], "properties": {
                "results": {"type": "array", "items": {"type": "object", "properties": {
                    "cursor": {"type": "integer"}, "sample": of("Sample")}}},
                "next": {"type": "integer", "description": "pass as `after` for the next page"}}}))}
        }},
        "/v1/admin/pause": {"post": {
            "summary": "Hold new generations for a weight update; answers when none is in flight (or the wait ran out)",
            "operationId": "pause",
            "parameters": [{"name": "wait", "in": "query", "schema": {"type": "integer", "default": 300, "maximum": 600}}],
            "responses": {"200": ok("Paused", gate()), "409": err("The node runs without capture")}
        }},
        "/v1/admin/resume": {"post": {
            "summary": "Let generations go on, under a new policy version when given",
            "operationId": "resume",
            "requestBody": {"required": false, "content": {"application/json": {"schema": {"type": "object", "properties": {
                "policy_version": {"type": "string"}}}}}},
            "responses": {"200": ok("Resumed", gate()), "400": err("Invalid body"), "409": err("The node runs without capture")}
        }},
        "/v1/admin/status": {"get": {
            "summary": "Whether generations are paused, how many are in flight, the policy version",
            "operationId": "gateStatus",
            "responses": {"200": ok("The gate", gate()), "409": err("The node runs without capture")}
        }}
    });
    let mut doc = json!({
        "openapi": "3.0.3",
        "info": {
            "title": "tokentap rollout node",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Tasks in, rewarded token-faithful trajectories out. Every route but /health (this document and /metrics included) needs `Authorization: Bearer TOKEN` when the node has a token."
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}
        },
        "security": [{"bearer": []}]
    });
    keep_keywords_beside_refs(&mut doc);
    doc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refs<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
        match v {
            Value::Object(o) => {
                if let Some(Value::String(r)) = o.get("$ref") {
                    out.push(r);
                }
                o.values().for_each(|v| refs(v, out));
            }
            Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }

    #[test]
    fn every_reference_resolves() {
        let doc = document();
        let mut found = Vec::new();
        refs(&doc, &mut found);
        assert!(found.len() > 10);
        for r in found {
            let name = r
                .strip_prefix("#/components/schemas/")
                .unwrap_or_else(|| panic!("{r}"));
            assert!(
                doc["components"]["schemas"][name].is_object(),
                "{r} is not defined"
            );
        }
    }

    /// A `$ref` stands alone (OpenAPI 3.0 ignores its siblings), and what may be null says so
    /// where it counts: a running sample's outcome, trajectory and evaluation are null.
    #[test]
    fn nullable_references_are_nullable() {
        fn check(v: &Value) {
            match v {
                Value::Object(o) => {
                    assert!(
                        !o.contains_key("$ref") || o.len() == 1,
                        "keywords beside a $ref are ignored: {v}"
                    );
                    o.values().for_each(check);
                }
                Value::Array(a) => a.iter().for_each(check),
                _ => {}
            }
        }
        let doc = document();
        check(&doc);
        let sample = &doc["components"]["schemas"]["Sample"]["properties"];
        for field in ["outcome", "trajectory", "evaluation"] {
            assert_eq!(
                sample[field]["nullable"], true,
                "{field}: {}",
                sample[field]
            );
            assert!(
                sample[field]["allOf"][0]["$ref"].is_string(),
                "{}",
                sample[field]
            );
        }
    }

    #[test]
    fn the_document_lists_exactly_the_routes() {
        let doc = document();
        let mut listed: Vec<(String, String)> = Vec::new();
        for (path, ops) in doc["paths"].as_object().unwrap() {
            for method in ops.as_object().unwrap().keys() {
                listed.push((method.clone(), path.clone()));
            }
        }
        listed.sort();
        let mut want: Vec<(String, String)> = ROUTES
            .iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .collect();
        want.sort();
        assert_eq!(listed, want);
    }

    #[test]
    fn the_task_schema_names_the_harnesses_and_evaluators() {
        let doc = document().to_string();
        for name in [
            "qwen-code",
            "claude-code",
            "swebench",
            "session-completed",
            "callback_url",
        ] {
            assert!(doc.contains(name), "{name}");
        }
    }
}
