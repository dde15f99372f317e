//! AdmissionReview v1 (admission.k8s.io/v1): the request's envelope is read, the pod is
//! handed to [`crate::inject`], and the response carries the patch, base64 JSONPatch. Only
//! what the webhook reads is typed; the pod stays a JSON value so fields this code does not
//! know pass through untouched (the patch only adds).

use base64::Engine;
use serde_json::{json, Value};

use crate::inject::{plan, InjectConfig};

#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("not JSON: {0}")]
    NotJson(String),
    #[error(
        "not an AdmissionReview v1 (apiVersion admission.k8s.io/v1, kind AdmissionReview): got {0}"
    )]
    NotAReview(String),
    #[error("the AdmissionReview has no request.uid")]
    NoUid,
}

/// The AdmissionReview response for a request body.
pub fn admit(body: &[u8], config: &InjectConfig) -> Result<Value, ReviewError> {
    let review: Value =
        serde_json::from_slice(body).map_err(|e| ReviewError::NotJson(e.to_string()))?;
    let (api, kind) = (
        review["apiVersion"].as_str().unwrap_or(""),
        review["kind"].as_str().unwrap_or(""),
    );
    if api != "admission.k8s.io/v1" || kind != "AdmissionReview" {
        return Err(ReviewError::NotAReview(format!("{api} {kind}")));
    }
    let request = &review["request"];
    let uid = request["uid"].as_str().ok_or(ReviewError::NoUid)?;
    let mut response = json!({"uid": uid, "allowed": true});
    let is_pod_create = request["kind"]["kind"] == "Pod"
        && request["kind"]["group"].as_str().unwrap_or("").is_empty()
        && request["operation"] == "CREATE";
    if is_pod_create {
        let outcome = plan(&request["object"], config);
        if !outcome.patch.is_empty() {
            let patch = serde_json::to_vec(&outcome.patch).expect("a patch serializes");
            response["patchType"] = json!("JSONPatch");
            response["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(patch));
        }
        if !outcome.warnings.is_empty() {
            response["warnings"] = json!(outcome.warnings);
        }
    }
    Ok(json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": response,
    }))
}
