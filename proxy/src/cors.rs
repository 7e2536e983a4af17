//! Cross-origin requests from browser clients (`--cors-allow-origins`, off by default).
//!
//! The gateway answers preflights (`OPTIONS` with `Access-Control-Request-Method`) itself and
//! adds `Access-Control-Allow-Origin` to every answer for an allowed origin, its own and the
//! upstream's alike. An upstream's own `Access-Control-*` headers never reach the client: vLLM
//! allows every origin by default, and the gateway's setting must be the one that holds.

use http::HeaderMap;
use pingora_http::ResponseHeader;

/// Headers a browser may read from answers (besides the CORS-safelisted ones).
const EXPOSED: &str =
    "x-request-id, retry-after, x-switchyard-served-model, x-switchyard-route, x-switchyard-policy";
/// How long a browser may cache a preflight, in seconds.
const MAX_AGE_S: &str = "600";

/// The origins browser clients may call from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cors {
    /// Exact origins (`https://app.example.com`); `*` allows any.
    origins: Vec<String>,
}

impl Cors {
    /// From a comma-separated list (empty: cross-origin requests get no CORS headers).
    pub fn parse(list: &str) -> Result<Cors, String> {
        let mut origins = Vec::new();
        for origin in list.split(',').map(str::trim).filter(|o| !o.is_empty()) {
            let valid = origin == "*"
                || ((origin.starts_with("https://") || origin.starts_with("http://"))
                    && !origin.ends_with('/')
                    && origin.bytes().all(|b| b.is_ascii_graphic()));
            if !valid {
                return Err(format!(
                    "'{origin}' is not an origin: give scheme://host[:port] without a path, or *"
                ));
            }
            origins.push(origin.to_owned());
        }
        Ok(Cors { origins })
    }

    /// The `Access-Control-Allow-Origin` value for a request from `headers`' origin, when it
    /// is allowed.
    pub fn allow(&self, headers: &HeaderMap) -> Option<String> {
        let origin = headers.get(http::header::ORIGIN)?.to_str().ok()?;
        if self.origins.iter().any(|o| o == "*") {
            return Some("*".to_owned());
        }
        self.origins
            .iter()
            .any(|o| o.eq_ignore_ascii_case(origin))
            .then(|| origin.to_owned())
    }
}

/// Whether a request is a CORS preflight.
pub fn is_preflight(method: &http::Method, headers: &HeaderMap) -> bool {
    method == http::Method::OPTIONS
        && headers.contains_key(http::header::ORIGIN)
        && headers.contains_key(http::header::ACCESS_CONTROL_REQUEST_METHOD)
}

/// The headers of an answer to an allowed origin (`allow`: what [`Cors::allow`] gave).
pub fn answer_headers(allow: &str) -> Vec<(&'static str, String)> {
    let mut headers = vec![
        ("access-control-allow-origin", allow.to_owned()),
        ("access-control-expose-headers", EXPOSED.to_owned()),
    ];
    if allow != "*" {
        headers.push(("vary", "Origin".to_owned()));
    }
    headers
}

/// The extra headers of a preflight's answer: the methods of the path and the headers the
/// browser asked to send.
pub fn preflight_headers(methods: &str, request: &HeaderMap) -> Vec<(&'static str, String)> {
    let asked = request
        .get(http::header::ACCESS_CONTROL_REQUEST_HEADERS)
        .and_then(|v| v.to_str().ok())
        .filter(|v| v.bytes().all(|b| b.is_ascii_graphic() || b == b' '))
        .unwrap_or("authorization, content-type, x-api-key, anthropic-version")
        .to_owned();
    vec![
        ("access-control-allow-methods", methods.to_owned()),
        ("access-control-allow-headers", asked),
        ("access-control-max-age", MAX_AGE_S.to_owned()),
    ]
}

/// Drop an upstream's CORS headers and add the gateway's (`allow`: for an allowed origin).
pub fn rewrite_upstream(
    response: &mut ResponseHeader,
    allow: Option<&str>,
) -> pingora_error::Result<()> {
    let upstream: Vec<http::HeaderName> = response
        .headers
        .keys()
        .filter(|name| name.as_str().starts_with("access-control-"))
        .cloned()
        .collect();
    for name in upstream {
        response.remove_header(&name);
    }
    if let Some(allow) = allow {
        for (name, value) in answer_headers(allow) {
            response.append_header(name, value)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, value.parse().unwrap());
        }
        map
    }

    #[test]
    fn origins_are_checked_and_matched_exactly() {
        assert_eq!(Cors::parse("").unwrap(), Cors::default());
        assert!(Cors::parse("app.example.com").is_err());
        assert!(Cors::parse("https://app.example.com/").is_err());
        let cors = Cors::parse("https://app.example.com, http://localhost:3000").unwrap();
        let from = |origin: &str| cors.allow(&headers(&[("origin", origin)]));
        assert_eq!(
            from("https://app.example.com").as_deref(),
            Some("https://app.example.com")
        );
        assert_eq!(
            from("http://localhost:3000").as_deref(),
            Some("http://localhost:3000")
        );
        assert_eq!(from("https://evil.example.com"), None);
        assert_eq!(cors.allow(&HeaderMap::new()), None);
        let any = Cors::parse("*").unwrap();
        assert_eq!(
            any.allow(&headers(&[("origin", "https://x.test")]))
                .as_deref(),
            Some("*")
        );
        assert_eq!(
            Cors::default().allow(&headers(&[("origin", "https://x.test")])),
            None
        );
    }

    #[test]
    fn upstream_cors_headers_never_pass() {
        let mut response = ResponseHeader::build(200, None).unwrap();
        response
            .insert_header("access-control-allow-origin", "*")
            .unwrap();
        response
            .insert_header("access-control-allow-credentials", "true")
            .unwrap();
        rewrite_upstream(&mut response, None).unwrap();
        assert!(
            response
                .headers
                .get("access-control-allow-origin")
                .is_none()
        );
        assert!(
            response
                .headers
                .get("access-control-allow-credentials")
                .is_none()
        );
        rewrite_upstream(&mut response, Some("https://app.example.com")).unwrap();
        assert_eq!(
            response.headers.get("access-control-allow-origin").unwrap(),
            "https://app.example.com"
        );
        assert_eq!(response.headers.get("vary").unwrap(), "Origin");
    }
}
