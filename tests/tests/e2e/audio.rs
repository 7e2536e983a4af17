//! Speech to text through the gateway: multipart forms with the model rewritten in place and the
//! audio untouched, to simulated vLLM workers and to a recording upstream.

use switchyard_e2e::{Proxy, Sim, Upstream, pool_config, run_python};

/// The official SDK's `audio.transcriptions.create` and `audio.translations.create` through
/// the gateway to simulated workers, which answer 404 unless the form names their own model.
#[tokio::test]
async fn transcriptions_reach_simulated_workers_under_their_served_name() {
    let sim = Sim::start(&["--workers", "2", "--time-scale", "0.001", "--no-kv-events"]);
    let endpoints: Vec<String> = sim.workers.iter().map(|w| w.http.clone()).collect();
    let proxy = Proxy::start(
        &pool_config("asr", &sim.model, &endpoints, "", &["whisper"]),
        &[],
    )
    .await;
    let url = proxy.url();
    let output =
        tokio::task::spawn_blocking(move || run_python("sdk_audio.py", &[&url, "whisper"]))
            .await
            .unwrap();
    for check in [
        "audio.transcriptions",
        "audio.transcriptions as text",
        "audio.translations",
        "unknown model",
    ] {
        assert!(
            output.contains(&format!("ok: {check}")),
            "missing {check:?} in:\n{output}"
        );
    }
}

/// Every byte of the form but the model's value reaches the worker as sent (binary audio
/// included, with its boundary); a body that is not a form is refused with a reason.
#[tokio::test]
async fn forms_pass_byte_exact_but_the_model() {
    let upstream = Upstream::start("asr").await;
    let proxy = Proxy::start(
        &pool_config(
            "asr",
            "org/whisper",
            &[upstream.endpoint()],
            "",
            &["whisper"],
        ),
        &[],
    )
    .await;
    let audio: Vec<u8> = (0..=255u8)
        // Text that looks like (but is not) the delimiter.
        .chain(b"\r\n--b0undar\r\n-b0undary".iter().copied())
        .collect();
    let mut form = b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x.wav\"\r\nContent-Type: audio/wav\r\n\r\n".to_vec();
    form.extend_from_slice(&audio);
    form.extend_from_slice(b"\r\n--b0undary\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--b0undary\r\nContent-Disposition: form-data; name=\"language\"\r\n\r\nde\r\n--b0undary--\r\n");
    let response = reqwest::Client::new()
        .post(format!("{}/v1/audio/transcriptions", proxy.url()))
        .header("content-type", "multipart/form-data; boundary=b0undary")
        .body(form.clone())
        .send()
        .await
        .unwrap();
    // The recording upstream does not transcribe; what it received is the point.
    let _ = response.status();
    let received = upstream
        .received()
        .pop()
        .expect("the form reached the worker");
    assert_eq!(received.path, "/v1/audio/transcriptions");
    assert_eq!(
        received.headers.get("content-type").unwrap(),
        "multipart/form-data; boundary=b0undary"
    );
    let at = form
        .windows(13)
        .position(|w| w == b"\r\n\r\nwhisper\r\n")
        .unwrap()
        + 4;
    let mut expected = form[..at].to_vec();
    expected.extend_from_slice(b"org/whisper");
    expected.extend_from_slice(&form[at + "whisper".len()..]);
    assert_eq!(
        received.body.to_vec(),
        expected,
        "byte for byte, but the model"
    );

    // Two model fields: the gateway would read one, the worker the other.
    let mut twice = form.clone();
    twice.truncate(twice.len() - b"--b0undary--\r\n".len());
    twice.extend_from_slice(b"--b0undary\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nother\r\n--b0undary--\r\n");
    let refused = reqwest::Client::new()
        .post(format!("{}/v1/audio/transcriptions", proxy.url()))
        .header("content-type", "multipart/form-data; boundary=b0undary")
        .body(twice)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);

    let refused = reqwest::Client::new()
        .post(format!("{}/v1/audio/transcriptions", proxy.url()))
        .json(&serde_json::json!({"model": "whisper"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);
    let body: serde_json::Value = refused.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("multipart/form-data"),
        "{body}"
    );
}
