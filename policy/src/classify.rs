//! Prompt classification: personal-data detectors, the simple/complex classifier and
//! user-defined keyword/regex classes. It reads message text and returns a [`ClassSet`];
//! nothing here logs or keeps the text.

use aho_corasick::AhoCorasick;
use regex::{Regex, RegexBuilder};
use switchyard_snapshot::compile_policy::MAX_PATTERN_BYTES;
use switchyard_snapshot::snapshot::{BUILTIN_CLASSES, ClassDef, Complexity};

/// A set of prompt classes, one bit per class of a [`Classifier`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ClassSet(pub u64);

impl ClassSet {
    pub fn contains(self, class: ClassId) -> bool {
        self.0 & (1u64 << class.0) != 0
    }
    pub fn insert(&mut self, class: ClassId) {
        self.0 |= 1u64 << class.0;
    }
    pub fn intersects(self, other: ClassSet) -> bool {
        self.0 & other.0 != 0
    }
}

/// Index of a class in its classifier (< 64).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClassId(pub u8);

/// At most this many classes (built-in and user-defined together).
pub const MAX_CLASSES: usize = 64;

pub const PII: ClassId = ClassId(0);
pub const PII_EMAIL: ClassId = ClassId(1);
pub const PII_PHONE: ClassId = ClassId(2);
pub const PII_PAYMENT_CARD: ClassId = ClassId(3);
pub const PII_IBAN: ClassId = ClassId(4);
pub const PII_NATIONAL_ID: ClassId = ClassId(5);
pub const SIMPLE: ClassId = ClassId(6);
pub const COMPLEX: ClassId = ClassId(7);
pub const CODE: ClassId = ClassId(8);

/// The text of a request, as the classifier sees it.
pub trait PromptText {
    /// Call `visit` with every piece of message text (system, user, assistant, tool results).
    fn for_each_text(&self, visit: &mut dyn FnMut(&str));
    /// Call `visit` with every other string the request carries to the model (tool definitions,
    /// the `user` field, metadata, message names): searched for personal data and user classes,
    /// but not part of the prompt's length or complexity.
    fn for_each_other_text(&self, _visit: &mut dyn FnMut(&str)) {}
    /// Messages written by the user (the turns of the conversation).
    fn user_turns(&self) -> usize;
}

/// A prompt given as plain text segments (tests, the CLI).
#[derive(Debug, Clone, Default)]
pub struct Segments<'a> {
    pub texts: Vec<&'a str>,
    pub user_turns: usize,
}

impl PromptText for Segments<'_> {
    fn for_each_text(&self, visit: &mut dyn FnMut(&str)) {
        for text in &self.texts {
            visit(text);
        }
    }
    fn user_turns(&self) -> usize {
        self.user_turns
    }
}

struct UserClass {
    id: ClassId,
    personal_data: bool,
    keywords: Option<Keywords>,
    /// The class's patterns as one alternation.
    patterns: Option<Regex>,
}

/// Case-insensitive whole-word search for many keywords at once (Aho-Corasick over the
/// lowercased keywords; a hit counts only at word boundaries). Faster than a regex
/// alternation with `\b`, and it never allocates.
struct Keywords {
    automaton: AhoCorasick,
}

impl Keywords {
    fn new(keywords: &[String]) -> Option<Keywords> {
        if keywords.is_empty() {
            return None;
        }
        AhoCorasick::builder()
            .ascii_case_insensitive(true)
            .build(keywords.iter().map(|k| k.to_lowercase()))
            .ok()
            .map(|automaton| Keywords { automaton })
    }

    fn is_match(&self, text: &str) -> bool {
        let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        self.automaton.find_overlapping_iter(text).any(|hit| {
            let before = text.get(..hit.start()).and_then(|t| t.chars().next_back());
            let after = text.get(hit.end()..).and_then(|t| t.chars().next());
            !word(before) && !word(after)
        })
    }
}

/// Built from a snapshot's classes; cheap to share, safe to use from many threads.
pub struct Classifier {
    names: Vec<String>,
    user: Vec<UserClass>,
    complexity: Complexity,
    complex_keywords: Option<Keywords>,
    detectors: Detectors,
}

impl std::fmt::Debug for Classifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Classifier")
            .field("classes", &self.names)
            .finish()
    }
}

/// Why a classifier could not be built (the snapshot compiler checks the same things first).
#[derive(Debug, thiserror::Error)]
pub enum ClassifierError {
    #[error("more than {MAX_CLASSES} prompt classes")]
    TooManyClasses,
    #[error("class '{class}': {message}")]
    Pattern { class: String, message: String },
}

fn build(pattern: &str) -> Result<Regex, regex::Error> {
    RegexBuilder::new(pattern)
        .size_limit(MAX_PATTERN_BYTES)
        .build()
}

impl Classifier {
    pub fn new(
        classes: &[ClassDef],
        complexity: &Complexity,
    ) -> Result<Classifier, ClassifierError> {
        if BUILTIN_CLASSES.len() + classes.len() > MAX_CLASSES {
            return Err(ClassifierError::TooManyClasses);
        }
        let mut names: Vec<String> = BUILTIN_CLASSES.iter().map(|c| (*c).to_owned()).collect();
        let mut user = Vec::with_capacity(classes.len());
        for class in classes {
            let id = ClassId(names.len() as u8);
            names.push(class.name.clone());
            let alternatives: Vec<String> =
                class.patterns.iter().map(|p| format!("(?:{p})")).collect();
            let patterns = if alternatives.is_empty() {
                None
            } else {
                Some(
                    build(&alternatives.join("|")).map_err(|e| ClassifierError::Pattern {
                        class: class.name.clone(),
                        message: e.to_string(),
                    })?,
                )
            };
            user.push(UserClass {
                id,
                personal_data: class.personal_data,
                keywords: Keywords::new(&class.keywords),
                patterns,
            });
        }
        let complex_keywords = Keywords::new(&complexity.complex_keywords);
        Ok(Classifier {
            names,
            user,
            complexity: complexity.clone(),
            complex_keywords,
            detectors: Detectors::new().map_err(|e| ClassifierError::Pattern {
                class: "pii".to_owned(),
                message: e.to_string(),
            })?,
        })
    }

    /// The id of a class name, built-in or user-defined.
    pub fn id(&self, name: &str) -> Option<ClassId> {
        self.names
            .iter()
            .position(|n| n == name)
            .map(|index| ClassId(index as u8))
    }

    pub fn name(&self, id: ClassId) -> &str {
        self.names
            .get(usize::from(id.0))
            .map_or("?", String::as_str)
    }

    /// The names of the classes in a set, in class order.
    pub fn names(&self, set: ClassSet) -> Vec<&str> {
        (0..self.names.len())
            .filter(|i| set.contains(ClassId(*i as u8)))
            .filter_map(|i| self.names.get(i).map(String::as_str))
            .collect()
    }

    /// Every class of the prompt.
    pub fn classify(&self, prompt: &dyn PromptText) -> ClassSet {
        let mut set = ClassSet::default();
        let mut chars = 0usize;
        let mut code = false;
        let mut keyword = false;
        prompt.for_each_text(&mut |text| {
            let text = &*normalize(text);
            chars += text.chars().count();
            self.detectors.scan(text, &mut set);
            code = code || looks_like_code(text);
            keyword = keyword
                || self
                    .complex_keywords
                    .as_ref()
                    .is_some_and(|k| k.is_match(text));
            self.match_user_classes(text, &mut set);
        });
        prompt.for_each_other_text(&mut |text| {
            let text = &*normalize(text);
            self.detectors.scan(text, &mut set);
            self.match_user_classes(text, &mut set);
        });
        if code {
            set.insert(CODE);
        }
        let complex = code
            || keyword
            || chars > self.complexity.max_simple_chars as usize
            || prompt.user_turns() > self.complexity.max_simple_turns as usize;
        set.insert(if complex { COMPLEX } else { SIMPLE });
        set
    }
}

impl Classifier {
    fn match_user_classes(&self, text: &str, set: &mut ClassSet) {
        for class in &self.user {
            if !set.contains(class.id)
                && (class.keywords.as_ref().is_some_and(|k| k.is_match(text))
                    || class.patterns.as_ref().is_some_and(|p| p.is_match(text)))
            {
                set.insert(class.id);
                if class.personal_data {
                    set.insert(PII);
                }
            }
        }
    }
}

/// Text as the detectors read it: Unicode compatibility forms folded (NFKC: a full-width `＠`
/// is `@`, full-width digits are digits) and invisible format characters (zero-width spaces and
/// joiners, soft hyphens, word joiners, byte-order marks) removed, so they cannot hide personal
/// data. ASCII text is returned as it is, without a copy.
fn normalize(text: &str) -> std::borrow::Cow<'_, str> {
    use unicode_normalization::UnicodeNormalization;
    if text.is_ascii() {
        return std::borrow::Cow::Borrowed(text);
    }
    let invisible = |c: &char| {
        matches!(
            c,
            '\u{00ad}' | '\u{180e}' | '\u{200b}'..='\u{200f}' | '\u{2060}'..='\u{2064}' | '\u{feff}'
        )
    };
    std::borrow::Cow::Owned(text.chars().filter(|c| !invisible(c)).nfkc().collect())
}

/// Code: a fenced block, or several lines that read like source code.
fn looks_like_code(text: &str) -> bool {
    if text.contains("```") {
        return true;
    }
    let mut code_lines = 0;
    for line in text.lines() {
        let line = line.trim();
        let starts = [
            "def ",
            "fn ",
            "pub fn ",
            "class ",
            "import ",
            "#include",
            "function ",
            "const ",
            "let ",
            "return ",
            "for (",
            "if (",
            "public ",
            "package ",
            "SELECT ",
            "func ",
        ]
        .iter()
        .any(|p| line.starts_with(p));
        let ends = line.ends_with(';') || line.ends_with('{') || line == "}";
        if starts || ends {
            code_lines += 1;
            if code_lines >= 3 {
                return true;
            }
        }
    }
    false
}

/// The built-in personal-data detectors: a regular expression finds candidates, a checksum or
/// range check (Luhn, ISO 13616 mod 97, SSN rules, DNI letter) keeps the real ones.
struct Detectors {
    email: Regex,
    phone: Regex,
    card: Regex,
    iban: Regex,
    ssn: Regex,
    nino: Regex,
    dni: Regex,
}

impl Detectors {
    fn new() -> Result<Detectors, regex::Error> {
        let fixed = build;
        Ok(Detectors {
            email: fixed(r"(?i)\b[a-z0-9._%+-]+@[a-z0-9-]+(?:\.[a-z0-9-]+)*\.[a-z]{2,}\b")?,
            phone: fixed(
                r"(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\b\d{2,4}[ .-])\d{2,4}[ .-]\d{2,4}(?:[ .-]\d{2,4}){0,3}\b|\+\d{8,15}\b",
            )?,
            card: fixed(r"\b\d(?:[ -]?\d){12,18}\b")?,
            iban: fixed(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b")?,
            ssn: fixed(r"\b(\d{3})-(\d{2})-(\d{4})\b")?,
            nino: fixed(r"\b[A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z] ?\d{2} ?\d{2} ?\d{2} ?[A-D]\b")?,
            dni: fixed(r"\b(\d{8})-?([A-Z])\b")?,
        })
    }

    fn scan(&self, text: &str, set: &mut ClassSet) {
        fn found(set: &mut ClassSet, class: ClassId) {
            set.insert(class);
            set.insert(PII);
        }
        if !set.contains(PII_EMAIL) && text.contains('@') && self.email.is_match(text) {
            found(set, PII_EMAIL);
        }
        // Every numeric identifier has at least six digits close together: run the detectors
        // only on the windows around such digit runs (their letters included), not on the
        // whole text. Prose without numbers costs one pass over its bytes.
        for_each_digit_window(text, 6, |window| self.scan_numeric(window, set));
    }

    fn scan_numeric(&self, text: &str, set: &mut ClassSet) {
        fn found(set: &mut ClassSet, class: ClassId) {
            set.insert(class);
            set.insert(PII);
        }
        if !set.contains(PII_PAYMENT_CARD)
            && self.card.find_iter(text).any(|m| valid_card(m.as_str()))
        {
            found(set, PII_PAYMENT_CARD);
        }
        if !set.contains(PII_IBAN) && self.iban.find_iter(text).any(|m| valid_iban(m.as_str())) {
            found(set, PII_IBAN);
        }
        if !set.contains(PII_NATIONAL_ID)
            && (self.ssn.captures_iter(text).any(|c| {
                valid_ssn(
                    c.get(1).map_or("", |m| m.as_str()),
                    c.get(2).map_or("", |m| m.as_str()),
                    c.get(3).map_or("", |m| m.as_str()),
                )
            }) || self.nino.is_match(text)
                || self.dni.captures_iter(text).any(|c| {
                    valid_dni(
                        c.get(1).map_or("", |m| m.as_str()),
                        c.get(2).map_or("", |m| m.as_str()),
                    )
                }))
        {
            found(set, PII_NATIONAL_ID);
        }
        if !set.contains(PII_PHONE)
            && self
                .phone
                .find_iter(text)
                .any(|m| plausible_phone(text, m.start(), m.as_str()))
        {
            found(set, PII_PHONE);
        }
    }
}

/// Bytes of context kept on each side of a digit run: an IBAN's country code, check digits
/// and bank letters (`GB82WEST`), a NINO's prefix letters, a DNI's check letter.
const WINDOW_CONTEXT: usize = 12;

/// Call `visit` with each stretch of `text` around a run of digits and separators (space,
/// `-`, `.`, `(`, `)`, `+`, `/`) that holds at least `wanted` digits, context included;
/// overlapping stretches are merged.
fn for_each_digit_window(text: &str, wanted: usize, mut visit: impl FnMut(&str)) {
    let bytes = text.as_bytes();
    let mut pending: Option<(usize, usize)> = None;
    let mut run_start = 0;
    let mut digits_in_run = 0;
    let mut flush = |start: usize, end: usize, pending: &mut Option<(usize, usize)>| {
        let start = floor_char_boundary(text, start.saturating_sub(WINDOW_CONTEXT));
        let end = ceil_char_boundary(text, (end + WINDOW_CONTEXT).min(text.len()));
        match pending {
            Some((_, last_end)) if start <= *last_end => *last_end = end,
            _ => {
                if let Some((s, e)) = pending.take()
                    && let Some(window) = text.get(s..e)
                {
                    visit(window);
                }
                *pending = Some((start, end));
            }
        }
    };
    for (index, byte) in bytes.iter().enumerate() {
        if byte.is_ascii_digit() {
            if digits_in_run == 0 {
                run_start = index;
            }
            digits_in_run += 1;
        } else if !matches!(byte, b' ' | b'-' | b'.' | b'(' | b')' | b'+' | b'/') {
            if digits_in_run >= wanted {
                flush(run_start, index, &mut pending);
            }
            digits_in_run = 0;
        }
    }
    if digits_in_run >= wanted {
        flush(run_start, bytes.len(), &mut pending);
    }
    if let Some((s, e)) = pending
        && let Some(window) = text.get(s..e)
    {
        visit(window);
    }
}

fn floor_char_boundary(text: &str, mut index: usize) -> usize {
    while index > 0 && !text.is_char_boundary(index) {
        index -= 1;
    }
    index
}

fn ceil_char_boundary(text: &str, mut index: usize) -> usize {
    while index < text.len() && !text.is_char_boundary(index) {
        index += 1;
    }
    index
}

fn digits(text: &str) -> impl Iterator<Item = u32> + '_ {
    text.chars().filter_map(|c| c.to_digit(10))
}

/// Payment card: 13-19 digits, a known issuer prefix, and a valid Luhn check digit.
/// (No allocation: candidates are checked on the request path.)
pub fn valid_card(candidate: &str) -> bool {
    let length = digits(candidate).count();
    if !(13..=19).contains(&length) {
        return false;
    }
    let prefix = |n: usize| digits(candidate).take(n).fold(0u32, |acc, d| acc * 10 + d);
    let issuer = prefix(1) == 4
        || (51..=55).contains(&prefix(2))
        || (2221..=2720).contains(&prefix(4))
        || matches!(prefix(2), 34 | 37 | 35 | 36 | 65)
        || prefix(4) == 6011
        || prefix(2) == 62;
    if !issuer {
        return false;
    }
    let sum: u32 = candidate
        .chars()
        .rev()
        .filter_map(|c| c.to_digit(10))
        .enumerate()
        .map(|(i, d)| {
            if i % 2 == 1 {
                let doubled = d * 2;
                if doubled > 9 { doubled - 9 } else { doubled }
            } else {
                d
            }
        })
        .sum();
    sum.is_multiple_of(10)
}

/// IBAN: ISO 13616 length 15-34 and the mod-97 check (country and check digits moved last).
pub fn valid_iban(candidate: &str) -> bool {
    let compact = || candidate.chars().filter(|c| !c.is_whitespace());
    if !(15..=34).contains(&compact().count()) {
        return false;
    }
    let mut remainder: u64 = 0;
    for c in compact().skip(4).chain(compact().take(4)) {
        let value = match c.to_digit(36) {
            Some(v) => u64::from(v),
            None => return false,
        };
        remainder = if value >= 10 {
            (remainder * 100 + value) % 97
        } else {
            (remainder * 10 + value) % 97
        };
    }
    remainder == 1
}

/// US Social Security Number: area not 000, 666 or 9xx; group not 00; serial not 0000.
pub fn valid_ssn(area: &str, group: &str, serial: &str) -> bool {
    area != "000" && area != "666" && !area.starts_with('9') && group != "00" && serial != "0000"
}

/// Spanish DNI: eight digits and the check letter.
pub fn valid_dni(number: &str, letter: &str) -> bool {
    const LETTERS: &[u8] = b"TRWAGMYFPDXBNJZSQVHLCKE";
    let Ok(value) = number.parse::<u32>() else {
        return false;
    };
    LETTERS
        .get((value % 23) as usize)
        .is_some_and(|expected| letter.as_bytes() == [*expected])
}

/// A phone candidate: 9-15 digits, not a date, time or version number, and not glued to more
/// digits or letters.
fn plausible_phone(text: &str, start: usize, candidate: &str) -> bool {
    let count = digits(candidate).count();
    if !(9..=15).contains(&count) {
        return false;
    }
    if candidate.contains('.') && !candidate.contains(' ') && !candidate.starts_with('+') {
        // 10.0.0.12 or 1.2.3456: addresses and versions, not phones.
        return false;
    }
    // Lengths of the digit groups (a phone candidate has at most 8).
    let mut lengths = [0usize; 8];
    let mut count = 0;
    for group in candidate
        .split(|c: char| !c.is_ascii_digit())
        .filter(|g| !g.is_empty())
    {
        if let Some(slot) = lengths.get_mut(count) {
            *slot = group.len();
        }
        count += 1;
    }
    let groups = lengths.get(..count.min(lengths.len())).unwrap_or_default();
    if groups.starts_with(&[4, 2, 2]) || groups.ends_with(&[2, 2, 4]) || groups == [3, 2, 4] {
        // 2024-01-15 12 or 15.01.2024: dates; 123-45-6789: the SSN shape, a national ID.
        return false;
    }
    let before = text.get(..start).and_then(|s| s.chars().next_back());
    !before.is_some_and(|c| c.is_alphanumeric() || c == '.' || c == '/' || c == ':')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classify(classifier: &Classifier, text: &str) -> Vec<String> {
        let set = classifier.classify(&Segments {
            texts: vec![text],
            user_turns: 1,
        });
        classifier
            .names(set)
            .into_iter()
            .map(str::to_owned)
            .collect()
    }

    fn default_classifier() -> Classifier {
        Classifier::new(&[], &Complexity::default()).unwrap()
    }

    #[test]
    fn personal_data_is_found_in_every_field_and_behind_unicode_tricks() {
        use crate::request::RequestPrompt;
        let classifier = default_classifier();
        let has_email = |body: &str| {
            let prompt = RequestPrompt::parse(body.as_bytes()).unwrap();
            classifier
                .names(classifier.classify(&prompt))
                .contains(&"pii.email")
        };
        let message = |text: &str| {
            serde_json::json!({"messages": [{"role": "user", "content": text}]}).to_string()
        };
        // The probes that got through: a tool's description, the `user` field, a full-width
        // at sign, a zero-width space inside the address.
        assert!(has_email(
            r#"{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f","description":"mail ann.lee@example.com"}}]}"#
        ));
        assert!(has_email(
            r#"{"messages":[{"role":"user","content":"hi"}],"user":"ann.lee@example.com"}"#
        ));
        assert!(has_email(&message("write to ann.lee＠example.com")));
        assert!(has_email(&message("write to ann.lee@\u{200b}example.com")));
        assert!(has_email(&message(
            "write to ann.lee\u{200d}@exam\u{00ad}ple.com"
        )));
        // Full-width digits are digits.
        assert!(
            classifier
                .names(
                    classifier.classify(
                        &RequestPrompt::parse(
                            message("card ４１１１ １１１１ １１１１ １１１１").as_bytes()
                        )
                        .unwrap()
                    )
                )
                .contains(&"pii.payment-card")
        );
        // Tool definitions do not make a short prompt complex.
        let prompt = RequestPrompt::parse(
            format!(
                r#"{{"messages":[{{"role":"user","content":"hi"}}],"tools":[{{"type":"function","function":{{"name":"f","description":"{}"}}}}]}}"#,
                "word ".repeat(2_000)
            )
            .as_bytes(),
        )
        .unwrap();
        assert!(
            classifier
                .names(classifier.classify(&prompt))
                .contains(&"simple")
        );
        assert!(!has_email(&message("no address here, only ＠ signs")));
    }

    #[test]
    fn checksums() {
        assert!(valid_card("4111 1111 1111 1111"));
        assert!(!valid_card("4111 1111 1111 1112"));
        assert!(valid_card("5500-0000-0000-0004"));
        assert!(!valid_card("1234567812345670"), "no issuer starts with 1");
        assert!(valid_iban("DE89 3704 0044 0532 0130 00"));
        assert!(valid_iban("GB82WEST12345698765432"));
        assert!(!valid_iban("GB82WEST12345698765433"));
        assert!(valid_ssn("123", "45", "6789"));
        assert!(!valid_ssn("666", "45", "6789"));
        assert!(!valid_ssn("123", "00", "6789"));
        assert!(valid_dni("12345678", "Z"));
        assert!(!valid_dni("12345678", "A"));
    }

    #[test]
    fn detectors_name_what_they_found() {
        let c = default_classifier();
        assert_eq!(
            classify(&c, "mail me at jane.doe@example.com"),
            ["pii", "pii.email", "simple"]
        );
        assert_eq!(
            classify(&c, "card 4111 1111 1111 1111 exp 12/29"),
            ["pii", "pii.payment-card", "simple"]
        );
        assert_eq!(
            classify(&c, "call +44 20 7946 0958 tomorrow"),
            ["pii", "pii.phone", "simple"]
        );
        assert_eq!(
            classify(&c, "my SSN is 123-45-6789"),
            ["pii", "pii.national-id", "simple"]
        );
        assert_eq!(
            classify(&c, "IBAN DE89 3704 0044 0532 0130 00 please"),
            ["pii", "pii.iban", "simple"]
        );
        assert_eq!(classify(&c, "What is the capital of France?"), ["simple"]);
        assert_eq!(
            classify(&c, "server 10.0.0.12 runs v1.2.3456 since 2024-01-15 12:30"),
            ["simple"]
        );
    }

    #[test]
    fn numeric_detectors_find_identifiers_anywhere_in_long_text() {
        let c = default_classifier();
        let pad = "lorem ipsum 2024 dolor ".repeat(300);
        for (needle, class) in [
            ("card 4111 1111 1111 1111.", "pii.payment-card"),
            ("IBAN GB82WEST12345698765432 ok", "pii.iban"),
            ("NINO JG 10 37 59 A", "pii.national-id"),
            ("DNI 12345678Z", "pii.national-id"),
            ("call (415) 555-2671", "pii.phone"),
        ] {
            let text = format!("{pad}{needle} {pad}");
            assert!(classify(&c, &text).contains(&class.to_owned()), "{needle}");
        }
        let mut windows = Vec::new();
        for_each_digit_window(
            "aa 12 34 56 bb ccccccccccccccccccccccccccc 987654 é",
            6,
            |w| windows.push(w.to_owned()),
        );
        assert_eq!(
            windows,
            ["aa 12 34 56 bb ccccccccc", "ccccccccccc 987654 é"]
        );
        windows.clear();
        for_each_digit_window("no long numbers: 2024, 12 34", 6, |w| {
            windows.push(w.to_owned())
        });
        assert!(windows.is_empty());
    }

    #[test]
    fn complexity_follows_length_turns_code_and_keywords() {
        let c = default_classifier();
        assert_eq!(
            classify(&c, "Prove that there are infinitely many primes."),
            ["complex"]
        );
        assert_eq!(
            classify(&c, "Fix this:\n```rust\nfn main() {}\n```"),
            ["complex", "code"]
        );
        assert_eq!(classify(&c, &"word ".repeat(500)), ["complex"]);
        let turns = c.classify(&Segments {
            texts: vec!["hi"],
            user_turns: 5,
        });
        assert_eq!(c.names(turns), ["complex"]);
    }

    #[test]
    fn user_classes_with_keywords_and_patterns() {
        let classes = [
            ClassDef {
                name: "legal".into(),
                keywords: vec!["contract".into(), "nda".into()],
                patterns: vec![],
                personal_data: false,
            },
            ClassDef {
                name: "employee-id".into(),
                keywords: vec![],
                patterns: vec![r"\bEMP-\d{6}\b".into()],
                personal_data: true,
            },
        ];
        let c = Classifier::new(&classes, &Complexity::default()).unwrap();
        assert_eq!(classify(&c, "Review this NDA"), ["simple", "legal"]);
        assert_eq!(
            classify(&c, "Badge EMP-123456 lost"),
            ["pii", "simple", "employee-id"]
        );
        assert_eq!(classify(&c, "contracts"), ["simple"], "word boundary");
        assert_eq!(c.id("legal"), Some(ClassId(9)));
    }
}

#[cfg(test)]
mod labelled {
    //! Precision and recall on the labelled set kept in `testdata/classification.jsonl`.
    use super::*;

    #[test]
    fn precision_and_recall_on_the_labelled_set() {
        let text = include_str!("../testdata/classification.jsonl");
        let classifier = Classifier::new(&[], &Complexity::default()).unwrap();
        // Every built-in class but simple/complex (checked separately below).
        let classes: Vec<&str> = BUILTIN_CLASSES
            .iter()
            .copied()
            .filter(|c| !matches!(*c, "simple" | "complex"))
            .collect();
        // (true positives, false positives, false negatives) per class.
        let mut counts = vec![(0u32, 0u32, 0u32); classes.len()];
        let mut mistakes = Vec::new();
        let mut complexity_checked = 0;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let row: serde_json::Value = serde_json::from_str(line).unwrap();
            let prompt = row["text"].as_str().unwrap();
            let labels: Vec<&str> = row["labels"]
                .as_array()
                .unwrap()
                .iter()
                .map(|l| l.as_str().unwrap())
                .collect();
            let found = classifier.classify(&Segments {
                texts: vec![prompt],
                user_turns: 1,
            });
            let found = classifier.names(found);
            for (index, class) in classes.iter().enumerate() {
                let expected = labels.contains(class);
                let got = found.contains(class);
                let entry = &mut counts[index];
                match (expected, got) {
                    (true, true) => entry.0 += 1,
                    (false, true) => entry.1 += 1,
                    (true, false) => entry.2 += 1,
                    (false, false) => {}
                }
                if expected != got {
                    mistakes.push(format!("{class}: expected {expected}, got {got}: {prompt}"));
                }
            }
            for class in ["simple", "complex"] {
                if labels.contains(&class) {
                    complexity_checked += 1;
                    assert!(
                        found.contains(&class),
                        "{class} expected for {prompt}: {found:?}"
                    );
                }
            }
        }
        assert!(complexity_checked >= 10);
        for (class, (tp, fp, fn_)) in classes.iter().zip(&counts) {
            let precision = f64::from(*tp) / f64::from((tp + fp).max(1));
            let recall = f64::from(*tp) / f64::from((tp + fn_).max(1));
            println!(
                "{class:18} precision {precision:.2} recall {recall:.2} (tp {tp}, fp {fp}, fn {fn_})"
            );
            assert!(tp + fn_ > 0, "{class} has no labelled example");
            assert!(
                precision >= 0.95,
                "{class} precision {precision:.2}: {mistakes:#?}"
            );
            assert!(recall >= 0.9, "{class} recall {recall:.2}: {mistakes:#?}");
        }
    }
}
