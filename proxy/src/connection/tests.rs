use super::head::*;
use super::*;

fn refused(buf: &[u8]) -> Option<(&'static str, u16)> {
    match check_head(buf) {
        HeadCheck::Refused(reason, error) => Some((reason, error.status())),
        _ => None,
    }
}

#[test]
fn complete_and_partial_heads() {
    assert!(matches!(
        check_head(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"),
        HeadCheck::Complete
    ));
    assert!(matches!(
        check_head(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n"),
        HeadCheck::Partial
    ));
    // Identical duplicates are one length (RFC 9110 8.6).
    assert!(matches!(
        check_head(b"POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2, 2\r\n\r\n"),
        HeadCheck::Complete
    ));
    // A target Pingora escapes is left to it.
    assert!(matches!(
        check_head(b"GET /v1/models?q=a|b\"c HTTP/1.1\r\nHost: x\r\n\r\n"),
        HeadCheck::Complete
    ));
}

#[test]
fn refused_heads() {
    assert_eq!(
        refused(b"POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n"),
        Some(("malformed_head", 400))
    );
    assert_eq!(
        refused(b"POST / HTTP/1.1\r\nContent-Length: two\r\n\r\n"),
        Some(("malformed_head", 400))
    );
    assert_eq!(
        refused(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n"),
        Some(("malformed_head", 400))
    );
    assert_eq!(
        refused(b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n"),
        Some(("malformed_head", 400))
    );
    assert_eq!(
        refused(b"garbage garbage\r\n"),
        Some(("malformed_head", 400))
    );
    let mut many = b"GET / HTTP/1.1\r\n".to_vec();
    for i in 0..300 {
        many.extend_from_slice(format!("x-{i}: y\r\n").as_bytes());
    }
    many.extend_from_slice(b"\r\n");
    assert_eq!(refused(&many), Some(("head_too_large", 431)));
}

#[test]
fn path_from_the_request_line() {
    assert_eq!(
        request_path(b"POST /v1/messages?beta=true HTTP/1.1\r\nx: y"),
        Some("/v1/messages".to_owned())
    );
    assert_eq!(request_path(b"POST /v1/mess"), None);
    assert_eq!(request_path(b"\x16\x03\x01garbage"), None);
}

#[tokio::test]
async fn a_slow_head_times_out_and_a_large_one_is_refused() {
    let settings = ConnectionSettings {
        header_timeout: Duration::from_millis(200),
        max_header_bytes: 1024,
        ..ConnectionSettings::default()
    };
    // One byte, then silence: refused with 408 in the format of the path, once it is known.
    let (mut client, mut server) = tokio::io::duplex(64 * 1024);
    client
        .write_all(b"POST /v1/messages HTTP/1.1\r\nx-slow: ")
        .await
        .unwrap();
    match read_head(&mut server, &settings, true).await {
        Err(HeadError::Refused { error, path, .. }) => {
            assert_eq!(error.status(), 408);
            assert_eq!(path.as_deref(), Some("/v1/messages"));
        }
        other => panic!("expected 408, got {other:?}"),
    }
    // Silence from the start: closed without an answer.
    let (_client, mut server) = tokio::io::duplex(1024);
    assert!(matches!(
        read_head(&mut server, &settings, true).await,
        Err(HeadError::Silent)
    ));
    // Larger than the limit.
    let (mut client, mut server) = tokio::io::duplex(64 * 1024);
    let mut head = b"GET /v1/models HTTP/1.1\r\nx-big: ".to_vec();
    head.extend(std::iter::repeat_n(b'a', 4096));
    client.write_all(&head).await.unwrap();
    match read_head(&mut server, &settings, true).await {
        Err(HeadError::Refused { error, .. }) => assert_eq!(error.status(), 431),
        other => panic!("expected 431, got {other:?}"),
    }
    // A complete head comes back with the body bytes that followed it.
    let (mut client, mut server) = tokio::io::duplex(64 * 1024);
    client
        .write_all(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
        .await
        .unwrap();
    match read_head(&mut server, &settings, true).await {
        Ok(Head::Http1(head)) => assert!(head.ends_with(b"\r\n\r\n{}")),
        other => panic!("expected a head, got {other:?}"),
    }
    // The HTTP/2 preface, in two writes.
    let (mut client, mut server) = tokio::io::duplex(64 * 1024);
    client.write_all(&H2_PREFACE[..5]).await.unwrap();
    let reading = tokio::spawn(async move { read_head(&mut server, &settings, true).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    client.write_all(&H2_PREFACE[5..]).await.unwrap();
    assert!(matches!(reading.await.unwrap(), Ok(Head::Http2(_))));
}

#[test]
fn connection_slots_per_client_and_in_total() {
    let settings = ConnectionSettings {
        max_connections: 3,
        max_connections_per_client: 2,
        ..ConnectionSettings::default()
    };
    let open = OpenConnections::default();
    let a: IpAddr = "10.0.0.1".parse().unwrap();
    let b: IpAddr = "10.0.0.2".parse().unwrap();
    let first = open.admit(Some(a), &settings).unwrap();
    let _second = open.admit(Some(a), &settings).unwrap();
    assert_eq!(open.admit(Some(a), &settings).err(), Some("client_limit"));
    let _third = open.admit(Some(b), &settings).unwrap();
    assert_eq!(open.admit(Some(b), &settings).err(), Some("total_limit"));
    drop(first);
    assert_eq!(open.total.load(Ordering::Relaxed), 2);
    let _again = open.admit(Some(a), &settings).unwrap();
    assert_eq!(crate::lock(&open.per_client).get(&a), Some(&2));
}
