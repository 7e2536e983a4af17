//! Browser clients: CORS preflights answered by the gateway for the origins it allows (none by
//! default, whatever the workers allow), `HEAD` where `GET` is served, `OPTIONS` everywhere.

use reqwest::Method;
use serde_json::json;
use switchyard_e2e::one_worker_proxy;

const APP: &str = "https://app.example.com";

#[tokio::test]
async fn preflights_and_answers_carry_cors_only_for_allowed_origins() {
    let (_worker, proxy) =
        one_worker_proxy("w1", "m", &["chat"], &["--cors-allow-origins", APP]).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", proxy.url());
    let preflight = |origin: &'static str| {
        client
            .request(Method::OPTIONS, &url)
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization, content-type",
            )
            .send()
    };
    let allowed = preflight(APP).await.unwrap();
    assert_eq!(allowed.status(), 204);
    let header = |response: &reqwest::Response, name: &str| {
        response
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    assert_eq!(
        header(&allowed, "access-control-allow-origin").as_deref(),
        Some(APP)
    );
    assert_eq!(
        header(&allowed, "access-control-allow-methods").as_deref(),
        Some("POST, OPTIONS")
    );
    assert_eq!(
        header(&allowed, "access-control-allow-headers").as_deref(),
        Some("authorization, content-type")
    );
    assert_eq!(header(&allowed, "allow").as_deref(), Some("POST, OPTIONS"));
    let other = preflight("https://evil.example.com").await.unwrap();
    assert_eq!(other.status(), 204);
    assert_eq!(header(&other, "access-control-allow-origin"), None);

    // The answer itself: the gateway's CORS, never the worker's (which allows everyone).
    let body = json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]});
    let answer = client
        .post(&url)
        .header("origin", APP)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(
        header(&answer, "access-control-allow-origin").as_deref(),
        Some(APP)
    );
    assert_eq!(header(&answer, "vary").as_deref(), Some("Origin"));
    assert!(
        header(&answer, "access-control-expose-headers")
            .unwrap()
            .contains("x-request-id")
    );
    let foreign = client
        .post(&url)
        .header("origin", "https://evil.example.com")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(foreign.status(), 200);
    assert_eq!(header(&foreign, "access-control-allow-origin"), None);
    // Errors the gateway answers itself carry it too.
    let error = client
        .post(&url)
        .header("origin", APP)
        .json(&json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(error.status(), 404);
    assert_eq!(
        header(&error, "access-control-allow-origin").as_deref(),
        Some(APP)
    );
}

#[tokio::test]
async fn without_cors_nothing_is_allowed_and_head_and_options_still_work() {
    let (_worker, proxy) = one_worker_proxy("w1", "m", &["chat"], &[]).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", proxy.url());
    let preflight = client
        .request(Method::OPTIONS, &url)
        .header("origin", APP)
        .header("access-control-request-method", "POST")
        .send()
        .await
        .unwrap();
    assert_eq!(preflight.status(), 204);
    assert!(
        preflight
            .headers()
            .get("access-control-allow-origin")
            .is_none()
    );
    let body = json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]});
    let answer = client
        .post(&url)
        .header("origin", APP)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    assert!(
        answer
            .headers()
            .get("access-control-allow-origin")
            .is_none(),
        "the worker's own CORS header must not pass"
    );

    // HEAD where GET is served: the head of the GET answer, no body.
    let head = client
        .head(format!("{}/v1/models", proxy.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(head.status(), 200);
    let length: usize = head.headers()["content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(length > 0);
    assert!(head.bytes().await.unwrap().is_empty());
    let options = client
        .request(Method::OPTIONS, format!("{}/v1/models", proxy.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(options.status(), 204);
    assert_eq!(options.headers()["allow"], "GET, HEAD, OPTIONS");
    let wrong = client.head(&url).send().await.unwrap();
    assert_eq!(wrong.status(), 405);
    assert_eq!(wrong.headers()["allow"], "POST, OPTIONS");
}
