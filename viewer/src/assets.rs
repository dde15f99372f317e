//! The page itself: three files compiled into the binary (no CDN, nothing fetched from
//! elsewhere), and the headers every viewer response carries.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

const INDEX_HTML: &str = include_str!("../assets/index.html");
const VIEWER_JS: &str = include_str!("../assets/viewer.js");
const VIEWER_CSS: &str = include_str!("../assets/viewer.css");

/// Scripts and styles only from the viewer itself, requests only back to it, no frames, no
/// forms, no plugins: captured text that slipped past escaping still could not run or leak.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// `PREFIX/` (the page), its script and style, and `PREFIX` sent on to `PREFIX/`, so the
/// page's relative URLs resolve below the prefix.
pub fn router(prefix: &str) -> Router {
    let to = format!("{prefix}/");
    Router::new()
        .route(prefix, get(move || async move { Redirect::to(&to) }))
        .route(
            &format!("{prefix}/"),
            get(|| async { file("text/html; charset=utf-8", INDEX_HTML) }),
        )
        .route(
            &format!("{prefix}/viewer.js"),
            get(|| async { file("text/javascript; charset=utf-8", VIEWER_JS) }),
        )
        .route(
            &format!("{prefix}/viewer.css"),
            get(|| async { file("text/css; charset=utf-8", VIEWER_CSS) }),
        )
}

fn file(kind: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, kind)], body).into_response()
}

/// On every response of the viewer, pages, data and errors alike.
pub async fn security_headers(mut r: Response) -> Response {
    let h = r.headers_mut();
    let mut set = |name: header::HeaderName, value: &'static str| {
        h.insert(name, HeaderValue::from_static(value));
    };
    set(header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY);
    set(header::X_CONTENT_TYPE_OPTIONS, "nosniff");
    set(header::REFERRER_POLICY, "no-referrer");
    set(header::X_FRAME_OPTIONS, "DENY");
    // Captured prompts are not to linger in shared caches or the browser's disk cache.
    set(header::CACHE_CONTROL, "no-store");
    r
}
