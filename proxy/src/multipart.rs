//! `multipart/form-data` bodies (`/v1/audio/transcriptions`, `/v1/audio/translations`): the
//! gateway reads the plain fields it routes by (`model`, `stream`) and replaces the model's
//! value in place; the audio file and every other byte pass as the client sent them.

use std::ops::Range;

use bytes::{Bytes, BytesMut};

use crate::api::ApiError;

/// The boundary of a `multipart/form-data` content type.
pub fn boundary(content_type: &str) -> Option<&str> {
    let (kind, parameters) = content_type.split_once(';')?;
    if !kind.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    parameters.split(';').find_map(|parameter| {
        let (name, value) = parameter.split_once('=')?;
        name.trim()
            .eq_ignore_ascii_case("boundary")
            .then(|| value.trim().trim_matches('"'))
            .filter(|b| !b.is_empty() && b.len() <= 70)
    })
}

/// One part: its field name and where its value lies in the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    pub name: String,
    /// Set for file parts.
    pub filename: Option<String>,
    pub value: Range<usize>,
}

/// The parts of `body` (RFC 7578): names and value ranges. `Err` names what is malformed.
pub fn fields(body: &[u8], boundary: &str) -> Result<Vec<Field>, ApiError> {
    let malformed =
        |what: &str| ApiError::invalid("body", format!("malformed multipart body: {what}"));
    let delimiter = format!("--{boundary}");
    let delimiter = delimiter.as_bytes();
    let mut at = find(body, delimiter, 0).ok_or_else(|| malformed("no boundary"))?;
    let mut out = Vec::new();
    loop {
        let after = at + delimiter.len();
        if body.get(after..after + 2) == Some(b"--") {
            return Ok(out);
        }
        let headers_start = skip_line_end(body, after).ok_or_else(|| malformed("boundary line"))?;
        let mut next_delimiter = Vec::with_capacity(delimiter.len() + 2);
        next_delimiter.extend_from_slice(b"\r\n");
        next_delimiter.extend_from_slice(delimiter);
        // A part's headers end before its content, and within the part.
        let part_end = find(body, &next_delimiter, headers_start);
        let headers_end = find(body, b"\r\n\r\n", headers_start)
            .filter(|end| part_end.is_none_or(|part_end| *end < part_end))
            .filter(|end| *end > headers_start)
            .ok_or_else(|| malformed("part headers"))?;
        let headers = std::str::from_utf8(body.get(headers_start..headers_end).unwrap_or_default())
            .map_err(|_| malformed("part headers are not UTF-8"))?;
        let value_start = headers_end + 4;
        let value_end = find(body, &next_delimiter, value_start)
            .ok_or_else(|| malformed("unterminated part"))?;
        let disposition = headers
            .split("\r\n")
            .find_map(|line| {
                let (name, value) = line.split_once(':')?;
                name.trim()
                    .eq_ignore_ascii_case("content-disposition")
                    .then_some(value)
            })
            .ok_or_else(|| malformed("a part without Content-Disposition"))?;
        let parameter = |key: &str| {
            disposition.split(';').find_map(|p| {
                let (name, value) = p.split_once('=')?;
                (name.trim() == key).then(|| value.trim().trim_matches('"').to_owned())
            })
        };
        out.push(Field {
            name: parameter("name").ok_or_else(|| malformed("a part without a name"))?,
            filename: parameter("filename"),
            value: value_start..value_end,
        });
        at = value_end + 2;
    }
}

fn skip_line_end(body: &[u8], at: usize) -> Option<usize> {
    if body.get(at..at + 2) == Some(b"\r\n") {
        Some(at + 2)
    } else {
        None
    }
}

fn find(haystack: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    haystack
        .get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}

/// The text value of the plain field `name`.
pub fn text<'b>(body: &'b [u8], fields: &[Field], name: &str) -> Option<&'b str> {
    let field = fields
        .iter()
        .find(|f| f.name == name && f.filename.is_none())?;
    std::str::from_utf8(body.get(field.value.clone())?).ok()
}

/// `body` with the bytes of `span` replaced by `value`.
pub fn replaced(body: &Bytes, span: &Range<usize>, value: &str) -> Bytes {
    let (Some(head), Some(tail)) = (body.get(..span.start), body.get(span.end..)) else {
        return body.clone();
    };
    let mut out = BytesMut::with_capacity(body.len() + value.len());
    out.extend_from_slice(head);
    out.extend_from_slice(value.as_bytes());
    out.extend_from_slice(tail);
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body() -> Vec<u8> {
        let mut body =
            b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n".to_vec();
        body.extend_from_slice(b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n");
        body.extend_from_slice(&[0, 1, 2, b'\r', b'\n', b'-', b'-', 255]);
        body.extend_from_slice(b"\r\n--XyZ\r\nContent-Disposition: form-data; name=\"stream\"\r\n\r\ntrue\r\n--XyZ--\r\n");
        body
    }

    #[test]
    fn reads_fields_and_replaces_the_model_in_place() {
        assert_eq!(boundary("multipart/form-data; boundary=XyZ"), Some("XyZ"));
        assert_eq!(
            boundary("Multipart/Form-Data; charset=x; boundary=\"q r\""),
            Some("q r")
        );
        assert_eq!(boundary("application/json"), None);
        let body = body();
        let fields = fields(&body, "XyZ").unwrap();
        assert_eq!(
            fields.iter().map(|f| f.name.as_str()).collect::<Vec<_>>(),
            ["model", "file", "stream"]
        );
        assert_eq!(fields[1].filename.as_deref(), Some("a.wav"));
        assert_eq!(
            &body[fields[1].value.clone()],
            &[0, 1, 2, b'\r', b'\n', b'-', b'-', 255]
        );
        assert_eq!(text(&body, &fields, "model"), Some("whisper"));
        assert_eq!(text(&body, &fields, "stream"), Some("true"));
        assert_eq!(
            text(&body, &fields, "file"),
            None,
            "a file is not a text field"
        );
        let bytes = Bytes::from(body.clone());
        let out = replaced(&bytes, &fields[0].value, "org/whisper-large");
        let expected = String::from_utf8_lossy(&body)
            .replace("\r\n\r\nwhisper\r\n", "\r\n\r\norg/whisper-large\r\n");
        assert_eq!(String::from_utf8_lossy(&out), expected);
    }

    #[test]
    fn malformed_bodies_are_refused_with_a_reason() {
        for (bad, why) in [
            (&b"no boundary here"[..], "no boundary"),
            (
                b"--XyZ\r\nContent-Disposition: form-data; name=\"m\"\r\n\r\nvalue",
                "unterminated",
            ),
            (b"--XyZ\r\nX: y\r\n\r\nv\r\n--XyZ--", "Content-Disposition"),
            // No headers: the next part's are not borrowed.
            (
                b"--XyZ\r\n\r\nv\r\n--XyZ\r\nContent-Disposition: form-data; name=\"m\"\r\n\r\nx\r\n--XyZ--",
                "part headers",
            ),
        ] {
            let error = fields(bad, "XyZ").unwrap_err();
            assert!(error.message.contains(why), "{}", error.message);
        }
    }
}
