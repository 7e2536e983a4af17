//! Message content, both APIs: a string, or parts (OpenAI) and blocks (Anthropic) read as the
//! gateway needs them, each kept as sent besides.

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;
use switchyard_kv::tokenize::{ChatMessage, ContentPiece, MessageContent};

/// Message content: a string, or an array of parts (OpenAI) or blocks (Anthropic).
#[derive(Debug)]
pub enum Content<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<Part<'a>>),
    /// Anything else (left for the worker to refuse).
    Other,
}

/// One content part or block.
#[derive(Debug)]
pub struct Part<'a> {
    /// The part as sent.
    pub raw: &'a RawValue,
    pub fields: PartFields<'a>,
}

/// What the gateway reads of a part (all absent for a part that is not an object).
#[derive(Debug, Default, Deserialize)]
pub struct PartFields<'a> {
    #[serde(rename = "type", borrow, default)]
    pub kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub text: Option<Cow<'a, str>>,
    /// The text of OpenAI `refusal` parts and of `thinking` parts (raw: other blocks may carry
    /// fields of these names that are not strings).
    #[serde(borrow, default)]
    pub refusal: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub thinking: Option<&'a RawValue>,
    /// Anthropic `tool_result` blocks nest their content.
    #[serde(borrow, default)]
    pub content: Option<Content<'a>>,
    /// Anthropic `tool_use` blocks carry their arguments as `input`.
    #[serde(borrow, default)]
    pub input: Option<&'a RawValue>,
    /// Anthropic `tool_use` id and tool name; `tool_result`'s call.
    #[serde(borrow, default)]
    pub id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub tool_use_id: Option<&'a RawValue>,
    /// Anthropic images (and other blocks' sources): see [`PartFields::image_source`].
    #[serde(borrow, default)]
    pub source: Option<&'a RawValue>,
    /// OpenAI images (an object with `url`, or the URL itself): see [`PartFields::image_url`].
    #[serde(borrow, default)]
    pub image_url: Option<&'a RawValue>,
}

impl<'a> PartFields<'a> {
    /// An Anthropic image block's source, when it is an object.
    pub fn image_source(&self) -> Option<ImageSource<'a>> {
        serde_json::from_str(self.source?.get()).ok()
    }

    /// An OpenAI image part's URL (`{"url": ...}`, or the URL as a string, as vLLM takes it).
    pub fn image_url(&self) -> Option<Cow<'a, str>> {
        let raw = self.image_url?;
        if raw.get().starts_with('"') {
            return serde_json::from_str(raw.get()).ok();
        }
        serde_json::from_str::<ImageUrl<'a>>(raw.get()).ok()?.url
    }
}

/// Where an Anthropic image comes from.
#[derive(Debug, Default, Deserialize)]
pub struct ImageSource<'a> {
    #[serde(rename = "type", borrow, default)]
    pub kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub media_type: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub data: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    pub url: Option<Cow<'a, str>>,
}

#[derive(Debug, Default, Deserialize)]
pub struct ImageUrl<'a> {
    #[serde(borrow, default)]
    pub url: Option<Cow<'a, str>>,
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Content<'a>, D::Error> {
        struct ContentVisitor<'a>(std::marker::PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for ContentVisitor<'a> {
            type Value = Content<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }

            fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<Content<'a>, E> {
                Ok(Content::Text(Cow::Borrowed(text)))
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<Content<'a>, E> {
                Ok(Content::Text(Cow::Owned(text.to_owned())))
            }

            fn visit_string<E: de::Error>(self, text: String) -> Result<Content<'a>, E> {
                Ok(Content::Text(Cow::Owned(text)))
            }

            fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<Content<'a>, S::Error> {
                let mut parts = Vec::new();
                while let Some(raw) = seq.next_element::<&'de RawValue>()? {
                    // A part of a shape the gateway does not expect is the upstream's to judge:
                    // it is forwarded as sent, and reads as a part of no known type.
                    let fields = if raw.get().starts_with('{') {
                        serde_json::from_str(raw.get()).unwrap_or_default()
                    } else {
                        PartFields::default()
                    };
                    parts.push(Part { raw, fields });
                }
                Ok(Content::Parts(parts))
            }

            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Content<'a>, M::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Content::Other)
            }

            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Content<'a>, E> {
                Ok(Content::Other)
            }

            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Content<'a>, E> {
                Ok(Content::Other)
            }

            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Content<'a>, E> {
                Ok(Content::Other)
            }

            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Content<'a>, E> {
                Ok(Content::Other)
            }
        }

        deserializer.deserialize_any(ContentVisitor(std::marker::PhantomData))
    }
}

impl Content<'_> {
    pub(super) fn template_text(&self) -> String {
        ChatMessage::from_content("", self.message_content()).content
    }

    /// The content as vLLM takes it apart (see [`ContentPiece::of_part`], which this follows
    /// for the parts as sent).
    pub(super) fn message_content(&self) -> MessageContent {
        match self {
            Content::Text(text) => MessageContent::String(text.clone().into_owned()),
            Content::Parts(parts) => MessageContent::Parts(
                parts
                    .iter()
                    .map(|part| {
                        let raw_text = |raw: Option<&RawValue>| {
                            raw.and_then(|raw| serde_json::from_str::<String>(raw.get()).ok())
                        };
                        let text = if part.raw.get().starts_with('"') {
                            raw_text(Some(part.raw))
                        } else {
                            match part.fields.kind.as_deref() {
                                Some("text" | "input_text" | "output_text") | None => {
                                    part.fields.text.clone().map(Cow::into_owned)
                                }
                                Some("refusal") => raw_text(part.fields.refusal),
                                Some("thinking") => raw_text(part.fields.thinking),
                                Some(_) => None,
                            }
                        };
                        text.map_or_else(
                            || ContentPiece::Other(compact(part.raw)),
                            ContentPiece::Text,
                        )
                    })
                    .collect(),
            ),
            Content::Other => MessageContent::String(String::new()),
        }
    }

    /// The first part's text (vLLM reads an assistant item's `content[0].text`).
    pub(super) fn first_text(&self) -> String {
        match self {
            Content::Text(text) => text.clone().into_owned(),
            Content::Parts(parts) => parts.first().map_or_else(String::new, |part| {
                if part.raw.get().starts_with('"') {
                    serde_json::from_str(part.raw.get()).unwrap_or_default()
                } else {
                    part.fields.text.clone().unwrap_or_default().into_owned()
                }
            }),
            Content::Other => String::new(),
        }
    }
}

/// A raw value as compact JSON.
fn compact(raw: &RawValue) -> String {
    serde_json::from_str::<Value>(raw.get())
        .map_or_else(|_| raw.get().to_owned(), |v| v.to_string())
}
