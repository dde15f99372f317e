//! Bearer-token authentication of tokentap's HTTP control planes (`tokentap serve`, `worker`,
//! `view`, `node-agent`, `webhook`): one middleware, so all refuse the same way.
//!
//! Every route but `/health` goes behind [`require`] when a token is configured. The
//! comparison is constant-time ([`subtle`]), so response timing does not reveal how much of a
//! guessed token was right.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use subtle::ConstantTimeEq;

/// The token a control plane expects; `None`: open (loopback only, checked at start-up).
#[derive(Clone, Default)]
pub struct BearerToken(pub Option<Arc<str>>);

impl BearerToken {
    pub fn new(token: Option<&str>) -> BearerToken {
        BearerToken(token.map(Arc::from))
    }

    /// Whether `headers` carry `Authorization: Bearer <this token>` (always, when open).
    pub fn admits(&self, headers: &HeaderMap) -> bool {
        let Some(expected) = &self.0 else {
            return true;
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                // RFC 6750: the scheme is case-insensitive.
                let (scheme, rest) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
            })
            .unwrap_or("");
        // `ct_eq` on slices of different lengths is false without comparing contents; only the
        // length can leak, which a token's strength does not rest on.
        bool::from(given.as_bytes().ct_eq(expected.as_bytes()))
    }
}

/// The refusal: 401 with the control planes' JSON error shape and a `WWW-Authenticate` hint.
pub fn unauthorized() -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        Json(json!({"error": {
            "type": "unauthorized",
            "message": "a valid bearer token is required (Authorization: Bearer TOKEN)",
        }})),
    )
        .into_response()
}

/// Middleware: refuses requests without the token (use with `from_fn_with_state`).
pub async fn require(State(token): State<BearerToken>, req: Request, next: Next) -> Response {
    if token.admits(req.headers()) {
        next.run(req).await
    } else {
        unauthorized()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn with(auth: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(auth).unwrap());
        h
    }

    #[test]
    fn only_the_exact_token_is_admitted() {
        let t = BearerToken::new(Some("s3cret"));
        assert!(t.admits(&with("Bearer s3cret")));
        assert!(t.admits(&with("bearer s3cret")));
        for wrong in [
            "Bearer s3cre",
            "Bearer s3cret2",
            "Bearer ",
            "Basic s3cret",
            "s3cret",
            "Bearer S3CRET",
        ] {
            assert!(!t.admits(&with(wrong)), "{wrong}");
        }
        assert!(!t.admits(&HeaderMap::new()));
        assert!(BearerToken::new(None).admits(&HeaderMap::new()));
    }
}
