//! The Responses API through the gateway, against simulated vLLM workers that keep their
//! responses: the official SDK's `responses.create` (streamed and not), `previous_response_id`,
//! `retrieve`, `cancel` and `delete` each reach the worker that made the response; and a pool
//! that speaks only Chat Completions, reached through the translation.

use switchyard_e2e::{Proxy, Sim, pool_config, run_python};

async fn run_sdk(proxy: &Proxy, model: &str, extra: &[&str]) -> String {
    let url = proxy.url();
    let model = model.to_owned();
    let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        let mut args = vec![url.as_str(), model.as_str()];
        args.extend(extra.iter().map(String::as_str));
        run_python("sdk_responses.py", &args)
    })
    .await
    .unwrap()
}

fn assert_checks(output: &str, checks: &[&str]) {
    for check in checks {
        assert!(
            output.contains(&format!("ok: {check}")),
            "missing {check:?} in:\n{output}"
        );
    }
}

/// Round-robin over two workers: a continuation that were not sent to the worker holding the
/// response would land on the other one, which does not have it (404).
#[tokio::test]
async fn stored_responses_are_reached_on_the_worker_that_made_them() {
    let sim = Sim::start(&[
        "--workers",
        "2",
        "--time-scale",
        "0.001",
        "--no-kv-events",
        "--enable-responses-store",
    ]);
    let endpoints: Vec<String> = sim.workers.iter().map(|w| w.http.clone()).collect();
    let proxy = Proxy::start(
        &pool_config(
            "gen",
            &sim.model,
            &endpoints,
            "  loadBalancing: round-robin\n",
            &["assistant"],
        ),
        &[],
    )
    .await;
    let output = run_sdk(&proxy, "assistant", &[]).await;
    assert_checks(
        &output,
        &[
            "responses.create",
            "responses.create streamed",
            "previous_response_id",
            "responses.retrieve",
            "responses.cancel",
            "responses.delete reaches the worker",
            "unknown ids",
        ],
    );
}

/// A pool whose workers speak only Chat Completions (`responsesApi: translate`): requests and
/// answers, whole and streamed, are translated; a stored response cannot be continued.
#[tokio::test]
async fn responses_translate_to_chat_completions() {
    let sim = Sim::start(&["--workers", "1", "--time-scale", "0.001", "--no-kv-events"]);
    let endpoints: Vec<String> = sim.workers.iter().map(|w| w.http.clone()).collect();
    let proxy = Proxy::start(
        &pool_config(
            "gen",
            &sim.model,
            &endpoints,
            "  responsesApi: translate\n",
            &["assistant"],
        ),
        &[],
    )
    .await;
    let output = run_sdk(&proxy, "assistant", &["translated"]).await;
    assert_checks(
        &output,
        &[
            "responses.create",
            "responses.create streamed",
            "previous_response_id refused when translated",
        ],
    );
}

/// What a Responses request carries passes byte-exact (but the model, and the stream the
/// gateway asks for to assemble the whole answer), the answer names the client's alias (also
/// when it passes whole, after long instructions), and a stored response is reached only by the
/// tenant that made it, on the worker that made it; a deleted one is forgotten.
#[tokio::test]
async fn responses_pass_through_and_stay_with_their_tenant() {
    use serde_json::{Value, json};
    use switchyard_e2e::{Upstream, key_sha256};

    let first = Upstream::start("first").await;
    let second = Upstream::start("second").await;
    let yaml = format!(
        "apiVersion: switchyard.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: chat}}\nspec: {{model: org/chat, loadBalancing: round-robin, endpoints: [\"{}\", \"{}\"]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: InferenceModel\nmetadata: {{name: chat}}\nspec: {{targets: [{{pool: chat}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: Tenant\nmetadata: {{name: team-a}}\nspec: {{apiKeys: [{{sha256: {}}}]}}\n---\n\
         apiVersion: switchyard.dev/v1alpha1\nkind: Tenant\nmetadata: {{name: team-b}}\nspec: {{apiKeys: [{{sha256: {}}}]}}\n",
        first.endpoint(),
        second.endpoint(),
        key_sha256("key-a"),
        key_sha256("key-b"),
    );
    let proxy = Proxy::start(&yaml, &[]).await;
    let client = reqwest::Client::new();
    let call = |method: reqwest::Method, path: &str, key: &str, body: Option<String>| {
        let mut request = client
            .request(method, format!("{}{path}", proxy.url()))
            .bearer_auth(key);
        if let Some(body) = body {
            request = request
                .header("content-type", "application/json")
                .body(body);
        }
        async move {
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            (
                status,
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    };
    let instructions = "Keep every answer short. ".repeat(400);
    let sent = format!(
        r#"{{"model":"chat","instructions":{},"input":[{{"role":"user","content":"hi"}}],"reasoning":{{"effort":"low"}},"include":["reasoning.encrypted_content"],"x_vendor":{{"k":[1,2]}}}}"#,
        json!(instructions)
    );
    let (status, answer) = call(
        reqwest::Method::POST,
        "/v1/responses",
        "key-a",
        Some(sent.clone()),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["model"], "chat", "the client's alias");
    let id = answer["id"].as_str().unwrap().to_owned();
    let (maker, other) = if first.received().is_empty() {
        (&second, &first)
    } else {
        (&first, &second)
    };
    let received = maker.received().pop().unwrap();
    assert_eq!(received.path, "/v1/responses");
    // Asked for whole: streamed from the worker (so the gateway sees its first token) and
    // assembled from the stream's last event, which carries the whole response.
    assert_eq!(
        String::from_utf8(received.body.to_vec()).unwrap(),
        sent.replace(r#""model":"chat""#, r#""model":"org/chat""#)
            .replacen('{', r#"{"stream":true,"#, 1),
        "everything but the model and the stream passes byte-exact"
    );
    assert_eq!(answer["instructions"], json!(instructions));
    assert_eq!(
        answer["output"][0]["content"][0]["text"],
        format!("{0}-0 {0}-1 {0}-2 ", maker.name())
    );

    // Round-robin would send the next request to the other worker; the stored one goes back.
    for _ in 0..2 {
        let (status, fetched) = call(
            reqwest::Method::GET,
            &format!("/v1/responses/{id}?include[]=x"),
            "key-a",
            None,
        )
        .await;
        assert_eq!(status, 200, "{fetched}");
        assert_eq!(fetched["model"], "chat");
        let received = maker.received().pop().unwrap();
        assert_eq!(
            (received.method.as_str(), received.path.as_str()),
            ("GET", format!("/v1/responses/{id}").as_str())
        );
        assert_eq!(
            received.query.as_deref(),
            Some("include[]=x"),
            "the query goes along"
        );
    }
    let continued = format!(r#"{{"model":"chat","input":"more","previous_response_id":"{id}"}}"#);
    let (status, _) = call(
        reqwest::Method::POST,
        "/v1/responses",
        "key-a",
        Some(continued.clone()),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        maker.received().pop().unwrap().json()["previous_response_id"],
        id.as_str()
    );
    assert!(
        other.received().is_empty(),
        "nothing reached the other worker"
    );

    // Another tenant does not learn the response exists.
    for (method, body) in [
        (reqwest::Method::GET, None),
        (reqwest::Method::DELETE, None),
        (reqwest::Method::POST, Some(continued.clone())),
    ] {
        let path = if body.is_some() {
            "/v1/responses".to_owned()
        } else {
            format!("/v1/responses/{id}")
        };
        let (status, error) = call(method, &path, "key-b", body).await;
        assert_eq!(status, 404, "{error}");
        assert_eq!(error["error"]["code"], "response_not_found");
    }

    // Nor can it give its own response that id: the worker would keep it in A's place.
    let taken = format!(r#"{{"model":"chat","input":"x","request_id":"{id}"}}"#);
    let (status, error) = call(reqwest::Method::POST, "/v1/responses", "key-b", Some(taken)).await;
    assert_eq!(
        (status, error["error"]["code"].as_str()),
        (400, Some("response_id_taken")),
        "{error}"
    );

    let (status, deleted) = call(
        reqwest::Method::DELETE,
        &format!("/v1/responses/{id}"),
        "key-a",
        None,
    )
    .await;
    assert_eq!((status, deleted["deleted"].as_bool()), (200, Some(true)));
    assert_eq!(maker.received().pop().unwrap().method.as_str(), "DELETE");
    let (status, _) = call(
        reqwest::Method::GET,
        &format!("/v1/responses/{id}"),
        "key-a",
        None,
    )
    .await;
    assert_eq!(status, 404, "a deleted response is forgotten");
    assert!(other.received().is_empty());

    // A whole answer that passes as the worker sent it (not assembled: vLLM answers
    // `kv_transfer_params` whole only) names the client's alias too, past the long
    // instructions it echoes before the model.
    let whole = sent.replacen(
        '{',
        r#"{"kv_transfer_params":{"do_remote_decode":false},"#,
        1,
    );
    let (status, answer) = call(reqwest::Method::POST, "/v1/responses", "key-a", Some(whole)).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["model"],
        "chat",
        "the client's alias, past {} bytes of instructions",
        instructions.len()
    );
    let text = answer["output"][0]["content"][0]["text"].as_str().unwrap();
    assert!(text.contains(" saw "), "answered whole: {text}");
}
