//! The admission webhook (webhook/src/review.rs + inject.rs): an AdmissionReview body in, the
//! AdmissionReview response and its base64 JSONPatch out, in both injection modes.
//! Invariants: the response answers the request's uid and always allows; its patch is
//! base64 of a JSON array of RFC 6902 ops that applies (json-patch) to any pod-shaped object
//! the API server could send; the patched pod carries `tokentap.io/injected`, and admitting
//! it again patches nothing (injection is idempotent).
#![no_main]

use base64::Engine;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use tokentap_webhook::inject::{InjectConfig, Mode, INJECTED};
use tokentap_webhook::review::admit;

fn config(mode: Mode) -> InjectConfig {
    InjectConfig {
        image: "tokentap:fuzz".into(),
        default_mode: mode,
        ca_configmap: "tokentap-ca".into(),
        redirect_port: 15001,
        backend: Some("http://engine:8000".into()),
        backend_kind: Some("vllm".into()),
        ship_to: Some("http://worker:8900".into()),
        ship_token_secret: Some("worker-token".into()),
    }
}

fn is_object_or_absent(v: &Value) -> bool {
    v.is_null() || v.is_object()
}

fn is_array_of_objects_or_absent(v: &Value) -> bool {
    v.is_null() || v.as_array().is_some_and(|a| a.iter().all(Value::is_object))
}

/// What the API server's decoding guarantees of a Pod before admission.
fn pod_shaped(pod: &Value) -> bool {
    let meta = &pod["metadata"];
    let spec = &pod["spec"];
    let containers_ok = ["containers", "initContainers"].iter().all(|list| {
        is_array_of_objects_or_absent(&spec[list])
            && spec[list].as_array().is_none_or(|cs| {
                cs.iter().all(|c| {
                    is_array_of_objects_or_absent(&c["env"])
                        && is_array_of_objects_or_absent(&c["volumeMounts"])
                })
            })
    });
    pod.is_object()
        && meta.is_object()
        && is_object_or_absent(&meta["annotations"])
        && meta["annotations"]
            .as_object()
            .is_none_or(|m| m.values().all(Value::is_string))
        && is_object_or_absent(&meta["labels"])
        && spec.is_object()
        && is_array_of_objects_or_absent(&spec["volumes"])
        && containers_ok
}

fuzz_target!(|data: &[u8]| {
    for mode in [Mode::Transparent, Mode::Sidecar] {
        let config = config(mode);
        let Ok(answer) = admit(data, &config) else {
            continue;
        };
        let review: Value = serde_json::from_slice(data).expect("admitted bodies are JSON");
        let response = &answer["response"];
        assert_eq!(answer["kind"], "AdmissionReview");
        assert_eq!(response["uid"], review["request"]["uid"]);
        assert_eq!(response["allowed"], true);
        let Some(patch) = response["patch"].as_str() else {
            continue;
        };
        assert_eq!(response["patchType"], "JSONPatch");
        let ops = base64::engine::general_purpose::STANDARD
            .decode(patch)
            .expect("the patch is base64");
        let ops: Value = serde_json::from_slice(&ops).expect("of JSON");
        assert!(ops.as_array().is_some_and(|a| !a.is_empty()));
        let ops: json_patch::Patch = serde_json::from_value(ops).expect("of RFC 6902 ops");
        let pod = &review["request"]["object"];
        if !pod_shaped(pod) {
            continue;
        }
        let mut patched = pod.clone();
        if let Err(e) = json_patch::patch(&mut patched, &ops) {
            panic!("the patch does not apply: {e}\npod: {pod}\npatch: {ops:?}");
        }
        assert!(patched["metadata"]["annotations"][INJECTED].is_string());
        let mut again = review.clone();
        again["request"]["object"] = patched;
        let body = serde_json::to_vec(&again).expect("serializes");
        let second = admit(&body, &config).expect("the same review is admitted again");
        assert!(
            second["response"]["patch"].is_null(),
            "a re-admitted pod is patched again: {second}"
        );
    }
});
