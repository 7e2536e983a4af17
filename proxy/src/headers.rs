//! What crosses the boundary to an external provider: allow-lists of headers, both ways.
//!
//! A provider is another company's service reached with the gateway's own key. The client's
//! headers (cookies, `OpenAI-Organization`, `anthropic-beta`, internal tracing or auth headers)
//! are not the provider's business unless the operator lists them (`forwardHeaders`), and the
//! provider's own headers (`Server`, rate-limit counters of the gateway's account, cookies,
//! request ids) are not the client's. Workers of our own pools are not filtered: they are part
//! of the deployment.

use pingora_http::{RequestHeader, ResponseHeader};

/// Client request headers every provider receives: what the API itself needs. The gateway then
/// sets its own (key, host, length, request id, trace context).
const REQUEST_HEADERS: &[&str] = &["accept", "content-type", "anthropic-version"];

/// Provider response headers a client receives: framing, content and retry advice.
const RESPONSE_HEADERS: &[&str] = &[
    "content-type",
    "content-length",
    "transfer-encoding",
    "content-encoding",
    "cache-control",
    "date",
    "retry-after",
];

/// Drop every client header a provider should not see: all but [`REQUEST_HEADERS`] and the
/// provider's `forward` list (lowercase names).
pub fn keep_for_provider(request: &mut RequestHeader, forward: &[String]) {
    let dropped: Vec<http::HeaderName> = request
        .headers
        .keys()
        .filter(|name| {
            let name = name.as_str();
            !REQUEST_HEADERS.contains(&name) && !forward.iter().any(|f| f == name)
        })
        .cloned()
        .collect();
    for name in dropped {
        request.remove_header(&name);
    }
}

/// Drop every provider response header but [`RESPONSE_HEADERS`].
pub fn keep_from_provider(response: &mut ResponseHeader) {
    let dropped: Vec<http::HeaderName> = response
        .headers
        .keys()
        .filter(|name| !RESPONSE_HEADERS.contains(&name.as_str()))
        .cloned()
        .collect();
    for name in dropped {
        response.remove_header(&name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn providers_get_only_the_apis_headers_and_the_listed_ones() {
        let mut request = RequestHeader::build("POST", b"/v1/chat/completions", None).unwrap();
        for (name, value) in [
            ("content-type", "application/json"),
            ("accept", "text/event-stream"),
            ("anthropic-version", "2023-06-01"),
            ("cookie", "session=secret"),
            ("OpenAI-Organization", "org-client"),
            ("anthropic-beta", "tools-2024"),
            ("x-internal-auth", "secret"),
            ("user-agent", "sdk/1"),
        ] {
            request.insert_header(name, value).unwrap();
        }
        keep_for_provider(&mut request, &["anthropic-beta".to_owned()]);
        let mut kept: Vec<&str> = request.headers.keys().map(|n| n.as_str()).collect();
        kept.sort_unstable();
        assert_eq!(
            kept,
            vec![
                "accept",
                "anthropic-beta",
                "anthropic-version",
                "content-type"
            ]
        );
    }

    #[test]
    fn clients_get_none_of_the_providers_own_headers() {
        let mut response = ResponseHeader::build(429, None).unwrap();
        for (name, value) in [
            ("content-type", "application/json"),
            ("retry-after", "3"),
            ("server", "provider-edge/1.2"),
            ("openai-organization", "org-gateway"),
            ("x-ratelimit-remaining-requests", "42"),
            ("set-cookie", "__cf_bm=secret"),
            ("x-request-id", "req_provider"),
        ] {
            response.insert_header(name, value).unwrap();
        }
        keep_from_provider(&mut response);
        let mut kept: Vec<&str> = response.headers.keys().map(|n| n.as_str()).collect();
        kept.sort_unstable();
        assert_eq!(kept, vec!["content-type", "retry-after"]);
    }
}
