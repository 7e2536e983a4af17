//! Seeded benchmark workloads, sized in tokens of the shipped tokenizer: what the published
//! cache-aware vs random comparison ran.
//!
//! - shared-prefix: groups of requests that share a long system prompt, each with a short unique
//!   question;
//! - multi-turn: conversations that all open with one product-style system prompt and whose
//!   history grows turn by turn (a turn is sent only after the previous answer arrived and the
//!   user's think time passed);
//! - no-shared: unique prompts;
//! - zipf-prefix: many long system prompts (more than one worker's cache holds) whose popularity
//!   is Zipf-skewed: a few are hot, most are rarely reused;
//! - hot-prefix: one system prompt shared by every request, each with a long unique part, so
//!   that one worker cannot prefill them all alone: the prefix must live on more than one;
//! - bursty: shared-prefix requests arriving in bursts (same mean rate);
//! - varied-output: shared-prefix requests with heavy-tailed output lengths, so decode load
//!   differs widely between requests;
//! - heterogeneous: shared-prefix requests on a fleet where every third worker is 1.5x slower;
//! - mixed: three teams behind one endpoint, each conversation drawn from one of them: an
//!   assistant's multi-turn conversations, questions over the shared-prefix system prompts, and
//!   one-off documents whose lengths are lognormal around the prompt size (a few hundred tokens
//!   to several thousand), so cache affinity, queues and prompt sizes all pull at once.
//!
//! Every size is counted in content tokens (the message text alone, before the chat template adds
//! its role markers) with the tokenizer the simulator and the proxy use, so "2000 tokens" means
//! 2000 tokens to the workers. Output lengths are drawn per request from a lognormal around the
//! requested mean, and each request asks for exactly its length.

use std::collections::HashMap;

use anyhow::Context;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use switchyard_kv::tokenize::PromptTokenizer;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    SharedPrefix,
    MultiTurn,
    NoShared,
    ZipfPrefix,
    HotPrefix,
    Bursty,
    VariedOutput,
    Heterogeneous,
    Mixed,
}

impl WorkloadKind {
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::SharedPrefix => "shared-prefix",
            WorkloadKind::MultiTurn => "multi-turn",
            WorkloadKind::NoShared => "no-shared",
            WorkloadKind::ZipfPrefix => "zipf-prefix",
            WorkloadKind::HotPrefix => "hot-prefix",
            WorkloadKind::Bursty => "bursty",
            WorkloadKind::VariedOutput => "varied-output",
            WorkloadKind::Heterogeneous => "heterogeneous",
            WorkloadKind::Mixed => "mixed",
        }
    }

    /// Every workload, in the order the benchmark runs them.
    pub const ALL: [WorkloadKind; 9] = [
        WorkloadKind::SharedPrefix,
        WorkloadKind::MultiTurn,
        WorkloadKind::NoShared,
        WorkloadKind::ZipfPrefix,
        WorkloadKind::HotPrefix,
        WorkloadKind::Bursty,
        WorkloadKind::VariedOutput,
        WorkloadKind::Heterogeneous,
        WorkloadKind::Mixed,
    ];

    /// Conversations that start together (bursty: `size.burst`; else 1, one at a time).
    pub fn burst(self, size: &WorkloadSize) -> usize {
        match self {
            WorkloadKind::Bursty => size.burst.max(1),
            _ => 1,
        }
    }

    /// The step-time multiplier of each of `workers` simulated workers this workload needs
    /// (`None`: the fleet the benchmark was given). heterogeneous: every third worker is 1.5x
    /// slower (another card, a throttled one, a shared node).
    pub fn worker_speeds(self, workers: usize) -> Option<Vec<f64>> {
        match self {
            WorkloadKind::Heterogeneous => Some(
                (0..workers)
                    .map(|i| if i % 3 == 2 { 1.5 } else { 1.0 })
                    .collect(),
            ),
            _ => None,
        }
    }
}

/// Sizes of a workload. Text sizes are content tokens of the shipped tokenizer.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct WorkloadSize {
    pub requests: usize,
    /// shared-prefix: groups of requests sharing one system prompt.
    pub groups: usize,
    /// Tokens of a group's system prompt (shared-prefix) or of a whole prompt (no-shared).
    pub prompt_tokens: usize,
    /// shared-prefix: tokens of each request's unique question.
    pub question_tokens: usize,
    /// multi-turn: tokens of the one system prompt every conversation opens with.
    pub system_prompt_tokens: usize,
    /// multi-turn: tokens of each user turn.
    pub turn_tokens: usize,
    /// multi-turn: turns per conversation (requests / turns conversations).
    pub turns: usize,
    /// Mean tokens generated per request.
    pub output_tokens: usize,
    /// Sigma of the normal under the lognormal output length (0: every request gets the mean).
    pub output_sigma: f64,
    /// multi-turn: mean think time before each later turn, in model seconds (exponential).
    pub think_time_s: f64,
    /// zipf-prefix: distinct system prompts (each `prompt_tokens` long).
    pub zipf_prefixes: usize,
    /// zipf-prefix: the exponent s of the popularity law (rank k is drawn ∝ 1 / k^s).
    pub zipf_exponent: f64,
    /// hot-prefix: tokens of each request's unique part after the one shared system prompt.
    pub hot_suffix_tokens: usize,
    /// bursty: conversations per burst.
    pub burst: usize,
    /// varied-output: sigma of the normal under the lognormal output length.
    pub varied_output_sigma: f64,
}

/// A Zipf draw over ranks `0..n` with exponent `s`, by inverting the cumulative weights.
fn zipf(rng: &mut StdRng, cumulative: &[f64]) -> usize {
    let total = cumulative.last().copied().unwrap_or(0.0);
    let target = rng.random::<f64>() * total;
    cumulative
        .partition_point(|c| *c <= target)
        .min(cumulative.len().saturating_sub(1))
}

/// Cumulative Zipf weights of ranks `0..n` (rank k weighs 1 / (k + 1)^s).
fn zipf_cumulative(n: usize, s: f64) -> Vec<f64> {
    let mut total = 0.0;
    (0..n.max(1))
        .map(|k| {
            total += 1.0 / ((k + 1) as f64).powf(s);
            total
        })
        .collect()
}

const WORDS: &[&str] = &[
    "system", "policy", "customer", "invoice", "network", "latency", "river", "mountain",
    "history", "quantum", "garden", "engine", "protocol", "harbor", "ledger", "signal", "crystal",
    "forest", "market", "theory", "window", "bridge", "planet", "archive", "module", "pattern",
    "vector", "kernel", "summer", "copper",
];

fn pick(rng: &mut StdRng) -> &'static str {
    WORDS
        .get(rng.random_range(0..WORDS.len()))
        .copied()
        .unwrap_or("word")
}

/// Text of an exact number of tokens: random numbered words (the numbers keep prompts from
/// sharing prefixes by chance), each costed with the tokenizer.
pub struct TextGenerator<'a> {
    tokenizer: &'a PromptTokenizer,
    /// Tokens of each piece seen so far ("word123" or " word123"): there are only a few thousand.
    costs: HashMap<String, usize>,
}

impl<'a> TextGenerator<'a> {
    pub fn new(tokenizer: &'a PromptTokenizer) -> TextGenerator<'a> {
        TextGenerator {
            tokenizer,
            costs: HashMap::new(),
        }
    }

    /// Content tokens of `text`.
    pub fn count(&self, text: &str) -> anyhow::Result<usize> {
        Ok(self
            .tokenizer
            .encode(text)
            .context("tokenizing a workload prompt")?
            .len())
    }

    fn cost(&mut self, piece: &str) -> anyhow::Result<usize> {
        if let Some(cost) = self.costs.get(piece) {
            return Ok(*cost);
        }
        let cost = self.count(piece)?;
        self.costs.insert(piece.to_owned(), cost);
        Ok(cost)
    }

    /// `count` random texts of `target` tokens each (the system prompts a workload shares).
    pub fn texts(
        &mut self,
        rng: &mut StdRng,
        count: usize,
        target: usize,
    ) -> anyhow::Result<Vec<String>> {
        (0..count).map(|_| self.text(rng, target)).collect()
    }

    /// Random text of `target` tokens. Pieces are costed one at a time, which is exact for the
    /// shipped tokenizer (it pre-splits on spaces and isolates digits, so tokens never span two
    /// pieces); the whole text is then counted, and trimmed or extended should another tokenizer
    /// merge across pieces.
    pub fn text(&mut self, rng: &mut StdRng, target: usize) -> anyhow::Result<String> {
        let mut pieces: Vec<String> = Vec::new();
        let mut count = 0;
        while count < target {
            let remaining = target - count;
            let space = if pieces.is_empty() { "" } else { " " };
            let piece = format!("{space}{}{}", pick(rng), rng.random_range(0..1000));
            let cost = self.cost(&piece)?;
            if cost <= remaining {
                pieces.push(piece);
                count += cost;
                continue;
            }
            // The last token or two: a bare word (one token each for the shipped tokenizer).
            let start = rng.random_range(0..WORDS.len());
            let mut fitted = false;
            for offset in 0..WORDS.len() {
                let word = WORDS.get((start + offset) % WORDS.len()).copied();
                let bare = format!("{space}{}", word.unwrap_or("word"));
                let cost = self.cost(&bare)?;
                if cost > 0 && cost <= remaining {
                    pieces.push(bare);
                    count += cost;
                    fitted = true;
                    break;
                }
            }
            if !fitted {
                break;
            }
        }
        let mut text = pieces.concat();
        let mut actual = self.count(&text)?;
        // Only a tokenizer that merges across pieces gets here; a bounded walk towards the target.
        for _ in 0..64 {
            if actual == target {
                break;
            }
            if actual > target {
                if pieces.pop().is_none() {
                    break;
                }
            } else {
                let space = if pieces.is_empty() { "" } else { " " };
                pieces.push(format!("{space}{}", pick(rng)));
            }
            text = pieces.concat();
            actual = self.count(&text)?;
        }
        Ok(text)
    }
}

/// A standard normal draw (Box-Muller: `rand` alone has no normal distribution).
fn standard_normal(rng: &mut StdRng) -> f64 {
    // 1 - [0, 1) is (0, 1], so the logarithm is finite.
    let radius = (-2.0 * (1.0 - rng.random::<f64>()).ln()).sqrt();
    radius * (std::f64::consts::TAU * rng.random::<f64>()).cos()
}

/// One output length: lognormal with mean `mean` (mu = ln(mean) - sigma^2 / 2), rounded and
/// clamped to [1, 8 × mean] so a rare draw cannot blow past the model's context.
pub fn output_length(rng: &mut StdRng, mean: usize, sigma: f64) -> usize {
    let mean = mean.max(1) as f64;
    let sigma = sigma.max(0.0);
    let mu = mean.ln() - sigma * sigma / 2.0;
    let draw = (mu + sigma * standard_normal(rng)).exp().round();
    draw.clamp(1.0, 8.0 * mean) as usize
}

/// An exponential draw with mean `mean` (0 when the mean is 0).
fn exponential(rng: &mut StdRng, mean: f64) -> f64 {
    if mean <= 0.0 {
        return 0.0;
    }
    -(1.0 - rng.random::<f64>()).ln() * mean
}

/// One user turn and what the client does around it.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    pub user: String,
    /// Tokens the request asks for, exactly.
    pub output_tokens: usize,
    /// Model seconds the user thinks after the previous answer before sending this turn (0 for
    /// the first turn).
    pub think_s: f64,
}

/// One conversation: the turns' user messages, sent one after another with the history growing.
/// Single-request workloads are conversations of one turn.
#[derive(Debug, Clone)]
pub struct Conversation {
    pub system: Option<String>,
    pub turns: Vec<Turn>,
}

impl Conversation {
    /// The chat body of turn `turn`, given the answers to the earlier turns.
    pub fn request(&self, model: &str, turn: usize, answers: &[String]) -> Value {
        let mut messages = Vec::new();
        if let Some(system) = &self.system {
            messages.push(json!({"role": "system", "content": system}));
        }
        for (index, user) in self.turns.iter().take(turn + 1).enumerate() {
            messages.push(json!({"role": "user", "content": user.user}));
            if index < turn {
                messages.push(json!({"role": "assistant", "content": answers.get(index).cloned().unwrap_or_default()}));
            }
        }
        let output_tokens = self.turns.get(turn).map_or(1, |t| t.output_tokens.max(1));
        // vLLM stops early at an end-of-sequence token unless told otherwise: ignore_eos and
        // min_tokens (both vLLM sampling parameters) make it generate exactly max_tokens, so the
        // drawn length is what the workers decode.
        json!({
            "model": model,
            "messages": messages,
            "max_tokens": output_tokens,
            "min_tokens": output_tokens,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    }

    /// Requests this conversation sends.
    pub fn requests(&self) -> usize {
        self.turns.len()
    }
}

/// mixed: sigma of the normal under the lognormal length of a one-off document (its mean is the
/// prompt size; 0.8 puts a tenth of them under 0.26x the mean and a tenth over 2x).
const DOCUMENT_SIGMA: f64 = 0.8;

/// A multi-turn conversation over `system`: `size.turns` user turns of `size.turn_tokens`, each
/// after an exponential think time but the first.
fn assistant_conversation(
    rng: &mut StdRng,
    text: &mut TextGenerator<'_>,
    system: &str,
    size: &WorkloadSize,
) -> anyhow::Result<Conversation> {
    let turns = (0..size.turns.max(1))
        .map(|turn| {
            let user = text.text(rng, size.turn_tokens)?;
            let output_tokens = output_length(rng, size.output_tokens, size.output_sigma);
            let think_s = if turn == 0 {
                0.0
            } else {
                exponential(rng, size.think_time_s)
            };
            Ok(Turn {
                user,
                output_tokens,
                think_s,
            })
        })
        .collect::<anyhow::Result<Vec<Turn>>>()?;
    Ok(Conversation {
        system: Some(system.to_owned()),
        turns,
    })
}

/// Conversations in the order they start.
pub fn generate(
    kind: WorkloadKind,
    size: WorkloadSize,
    seed: u64,
    tokenizer: &PromptTokenizer,
) -> anyhow::Result<Vec<Conversation>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut text = TextGenerator::new(tokenizer);
    // One request on its own, its output length drawn with lognormal sigma `sigma`.
    let single_with = |rng: &mut StdRng, user: String, sigma: f64| Turn {
        user,
        output_tokens: output_length(rng, size.output_tokens, sigma),
        think_s: 0.0,
    };
    let single = |rng: &mut StdRng, user: String| single_with(rng, user, size.output_sigma);
    Ok(match kind {
        WorkloadKind::SharedPrefix
        | WorkloadKind::Bursty
        | WorkloadKind::VariedOutput
        | WorkloadKind::Heterogeneous => {
            let sigma = match kind {
                WorkloadKind::VariedOutput => size.varied_output_sigma,
                _ => size.output_sigma,
            };
            let systems = text.texts(&mut rng, size.groups.max(1), size.prompt_tokens)?;
            let mut conversations = Vec::with_capacity(size.requests);
            for i in 0..size.requests {
                let question = text.text(&mut rng, size.question_tokens)?;
                conversations.push(Conversation {
                    system: systems.get(i % systems.len()).cloned(),
                    turns: vec![single_with(&mut rng, question, sigma)],
                });
            }
            conversations.shuffle(&mut rng);
            conversations
        }
        WorkloadKind::ZipfPrefix => {
            let systems = text.texts(&mut rng, size.zipf_prefixes.max(1), size.prompt_tokens)?;
            let cumulative = zipf_cumulative(systems.len(), size.zipf_exponent);
            // Ranks are drawn, then mapped through a shuffle so popularity is not creation order.
            let mut order: Vec<usize> = (0..systems.len()).collect();
            order.shuffle(&mut rng);
            let mut conversations = Vec::with_capacity(size.requests);
            for _ in 0..size.requests {
                let rank = zipf(&mut rng, &cumulative);
                let system = order.get(rank).and_then(|i| systems.get(*i)).cloned();
                let question = text.text(&mut rng, size.question_tokens)?;
                conversations.push(Conversation {
                    system,
                    turns: vec![single(&mut rng, question)],
                });
            }
            conversations
        }
        WorkloadKind::HotPrefix => {
            let system = text.text(&mut rng, size.prompt_tokens)?;
            let mut conversations = Vec::with_capacity(size.requests);
            for _ in 0..size.requests {
                let suffix = text.text(&mut rng, size.hot_suffix_tokens)?;
                conversations.push(Conversation {
                    system: Some(system.clone()),
                    turns: vec![single(&mut rng, suffix)],
                });
            }
            conversations
        }
        WorkloadKind::MultiTurn => {
            // One system prompt for every conversation, as one product's assistant would have.
            let system = text.text(&mut rng, size.system_prompt_tokens)?;
            (0..size.requests.div_ceil(size.turns.max(1)))
                .map(|_| assistant_conversation(&mut rng, &mut text, &system, &size))
                .collect::<anyhow::Result<Vec<Conversation>>>()?
        }
        WorkloadKind::Mixed => {
            let assistant = text.text(&mut rng, size.system_prompt_tokens)?;
            let systems = text.texts(&mut rng, size.groups.max(1), size.prompt_tokens)?;
            let mut conversations = Vec::new();
            let mut requests = 0;
            while requests < size.requests {
                let next = match rng.random_range(0..3) {
                    0 => assistant_conversation(&mut rng, &mut text, &assistant, &size)?,
                    1 => {
                        let system = systems.choose(&mut rng).cloned();
                        let question = text.text(&mut rng, size.question_tokens)?;
                        Conversation {
                            system,
                            turns: vec![single(&mut rng, question)],
                        }
                    }
                    _ => {
                        let tokens = output_length(&mut rng, size.prompt_tokens, DOCUMENT_SIGMA);
                        let document = text.text(&mut rng, tokens)?;
                        Conversation {
                            system: None,
                            turns: vec![single(&mut rng, document)],
                        }
                    }
                };
                requests += next.requests();
                conversations.push(next);
            }
            conversations
        }
        WorkloadKind::NoShared => {
            let mut conversations = Vec::with_capacity(size.requests);
            for _ in 0..size.requests {
                let prompt = text.text(&mut rng, size.prompt_tokens)?;
                conversations.push(Conversation {
                    system: None,
                    turns: vec![single(&mut rng, prompt)],
                });
            }
            conversations
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::OnceLock;

    fn tokenizer() -> &'static PromptTokenizer {
        static TOKENIZER: OnceLock<PromptTokenizer> = OnceLock::new();
        TOKENIZER.get_or_init(|| PromptTokenizer::shipped().unwrap())
    }

    fn size() -> WorkloadSize {
        WorkloadSize {
            requests: 12,
            groups: 3,
            prompt_tokens: 50,
            question_tokens: 5,
            system_prompt_tokens: 40,
            turn_tokens: 20,
            turns: 4,
            output_tokens: 8,
            output_sigma: 0.5,
            think_time_s: 2.0,
            zipf_prefixes: 20,
            zipf_exponent: 1.1,
            hot_suffix_tokens: 25,
            burst: 4,
            varied_output_sigma: 1.5,
        }
    }

    fn tokens(text: &str) -> usize {
        tokenizer().encode(text).unwrap().len()
    }

    #[test]
    fn generated_text_has_exactly_the_target_tokens() {
        let mut rng = StdRng::seed_from_u64(3);
        let mut generator = TextGenerator::new(tokenizer());
        for target in [0, 1, 2, 3, 7, 30, 129, 1000, 2000] {
            let text = generator.text(&mut rng, target).unwrap();
            assert_eq!(tokens(&text), target, "{target}: {text:?}");
        }
    }

    #[test]
    fn every_workload_text_is_sized_in_tokens() {
        let shared = generate(WorkloadKind::SharedPrefix, size(), 5, tokenizer()).unwrap();
        for conversation in &shared {
            assert_eq!(tokens(conversation.system.as_deref().unwrap()), 50);
            assert_eq!(tokens(&conversation.turns[0].user), 5);
        }
        let multi = generate(WorkloadKind::MultiTurn, size(), 5, tokenizer()).unwrap();
        for conversation in &multi {
            assert_eq!(tokens(conversation.system.as_deref().unwrap()), 40);
            assert!(conversation.turns.iter().all(|t| tokens(&t.user) == 20));
        }
        let unique = generate(WorkloadKind::NoShared, size(), 5, tokenizer()).unwrap();
        assert!(unique.iter().all(|c| tokens(&c.turns[0].user) == 50));
    }

    #[test]
    fn lognormal_output_lengths_keep_their_mean_and_bounds() {
        let mut rng = StdRng::seed_from_u64(11);
        let draws: Vec<usize> = (0..2000)
            .map(|_| output_length(&mut rng, 32, 0.5))
            .collect();
        let mean = draws.iter().sum::<usize>() as f64 / draws.len() as f64;
        assert!((mean - 32.0).abs() < 3.2, "mean {mean}");
        assert!(draws.iter().all(|d| (1..=256).contains(d)));
        // Spread out, not a constant.
        assert!(draws.iter().any(|d| *d < 20) && draws.iter().any(|d| *d > 50));
        // Sigma 0 is a fixed length; the clamp holds even for an absurd sigma.
        assert!((0..100).all(|_| output_length(&mut rng, 32, 0.0) == 32));
        assert!((0..500).all(|_| (1..=24).contains(&output_length(&mut rng, 3, 5.0))));
    }

    #[test]
    fn requests_ask_for_exactly_their_drawn_length() {
        let shared = generate(WorkloadKind::SharedPrefix, size(), 7, tokenizer()).unwrap();
        let lengths: std::collections::HashSet<usize> =
            shared.iter().map(|c| c.turns[0].output_tokens).collect();
        assert!(lengths.len() > 1, "{lengths:?}");
        let body = shared[0].request("m", 0, &[]);
        let n = shared[0].turns[0].output_tokens as u64;
        assert_eq!(body["max_tokens"], n);
        assert_eq!(body["min_tokens"], n);
        assert_eq!(body["ignore_eos"], true);
    }

    #[test]
    fn workloads_are_seeded_and_shaped() {
        let shared = generate(WorkloadKind::SharedPrefix, size(), 7, tokenizer()).unwrap();
        assert_eq!(shared.len(), 12);
        let systems: std::collections::HashSet<_> =
            shared.iter().map(|c| c.system.clone()).collect();
        assert_eq!(systems.len(), 3);
        let again = generate(WorkloadKind::SharedPrefix, size(), 7, tokenizer()).unwrap();
        assert_eq!(shared[0].turns, again[0].turns);
        let other = generate(WorkloadKind::SharedPrefix, size(), 8, tokenizer()).unwrap();
        assert_ne!(shared[0].turns, other[0].turns);

        let multi = generate(WorkloadKind::MultiTurn, size(), 7, tokenizer()).unwrap();
        assert_eq!(multi.len(), 3);
        let third = multi[0].request("m", 2, &["a0".into(), "a1".into()]);
        let roles: Vec<&str> = third["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(
            roles,
            ["system", "user", "assistant", "user", "assistant", "user"]
        );

        let unique = generate(WorkloadKind::NoShared, size(), 7, tokenizer()).unwrap();
        assert!(
            unique
                .iter()
                .all(|c| c.system.is_none() && c.turns.len() == 1)
        );
    }

    #[test]
    fn multi_turn_shares_one_system_prompt_and_thinks_between_turns() {
        let mut size = size();
        size.requests = 400;
        let multi = generate(WorkloadKind::MultiTurn, size, 9, tokenizer()).unwrap();
        assert_eq!(multi.len(), 100);
        let systems: std::collections::HashSet<_> =
            multi.iter().map(|c| c.system.clone()).collect();
        assert_eq!(systems.len(), 1);
        // Distinct conversations otherwise.
        assert_ne!(multi[0].turns[0].user, multi[1].turns[0].user);
        assert!(multi.iter().all(|c| c.turns[0].think_s == 0.0));
        let thinks: Vec<f64> = multi
            .iter()
            .flat_map(|c| c.turns.iter().skip(1).map(|t| t.think_s))
            .collect();
        assert_eq!(thinks.len(), 300);
        let mean = thinks.iter().sum::<f64>() / thinks.len() as f64;
        assert!((mean - 2.0).abs() < 0.4, "mean think {mean}");
        assert!(thinks.iter().all(|t| *t >= 0.0));
        size.think_time_s = 0.0;
        let eager = generate(WorkloadKind::MultiTurn, size, 9, tokenizer()).unwrap();
        assert!(
            eager
                .iter()
                .flat_map(|c| &c.turns)
                .all(|t| t.think_s == 0.0)
        );
    }

    #[test]
    fn zipf_prefixes_are_skewed_and_the_hot_prefix_is_one() {
        let mut size = size();
        size.requests = 400;
        let zipf = generate(WorkloadKind::ZipfPrefix, size, 3, tokenizer()).unwrap();
        let mut counts: HashMap<String, usize> = HashMap::new();
        for conversation in &zipf {
            let system = conversation.system.clone().unwrap();
            assert_eq!(tokens(&system), 50);
            *counts.entry(system).or_default() += 1;
        }
        let mut counts: Vec<usize> = counts.into_values().collect();
        counts.sort_unstable_by(|a, b| b.cmp(a));
        // Rank 1 of 20 at s = 1.1 draws ~28% of requests; the rarest few are seen once or not.
        assert!(counts[0] > 80 && counts[0] < 150, "{counts:?}");
        assert!(counts.len() > 12, "{counts:?}");
        assert!(counts[0] > 5 * counts[counts.len() / 2], "{counts:?}");

        let hot = generate(WorkloadKind::HotPrefix, size, 3, tokenizer()).unwrap();
        let systems: std::collections::HashSet<_> = hot.iter().map(|c| c.system.clone()).collect();
        assert_eq!(systems.len(), 1);
        assert!(hot.iter().all(|c| tokens(&c.turns[0].user) == 25));
    }

    #[test]
    fn mixed_draws_each_conversation_from_one_of_three_teams() {
        let mut size = size();
        size.requests = 300;
        let mixed = generate(WorkloadKind::Mixed, size, 6, tokenizer()).unwrap();
        let requests: usize = mixed.iter().map(Conversation::requests).sum();
        assert!((300..300 + size.turns).contains(&requests), "{requests}");
        let assistant: Vec<&Conversation> = mixed.iter().filter(|c| c.turns.len() > 1).collect();
        let questions: Vec<&Conversation> = mixed
            .iter()
            .filter(|c| c.turns.len() == 1 && c.system.is_some())
            .collect();
        let documents: Vec<usize> = mixed
            .iter()
            .filter(|c| c.system.is_none())
            .map(|c| tokens(&c.turns[0].user))
            .collect();
        // Each team draws about a third of the conversations.
        for team in [assistant.len(), questions.len(), documents.len()] {
            assert!(team * 5 > mixed.len(), "{team} of {}", mixed.len());
        }
        // The assistant's conversations share its one system prompt, and it is none of the groups'.
        let prompts: std::collections::HashSet<_> = assistant.iter().map(|c| &c.system).collect();
        assert_eq!(prompts.len(), 1);
        assert!(assistant.iter().all(|c| c.turns.len() == size.turns));
        let groups: std::collections::HashSet<_> = questions.iter().map(|c| &c.system).collect();
        assert_eq!(groups.len(), size.groups);
        assert!(groups.iter().all(|g| !prompts.contains(g)));
        assert!(
            questions
                .iter()
                .all(|c| tokens(&c.turns[0].user) == size.question_tokens)
        );
        // Documents are lognormal around the prompt size: some well under it, some well over.
        assert!(
            documents.iter().any(|t| *t * 2 < size.prompt_tokens),
            "{documents:?}"
        );
        assert!(
            documents.iter().any(|t| *t > 2 * size.prompt_tokens),
            "{documents:?}"
        );
        assert!(
            documents
                .iter()
                .all(|t| (1..=8 * size.prompt_tokens).contains(t))
        );
        let again = generate(WorkloadKind::Mixed, size, 6, tokenizer()).unwrap();
        assert_eq!(mixed.len(), again.len());
        assert!(mixed.iter().zip(&again).all(|(a, b)| a.turns == b.turns));
    }

    #[test]
    fn variants_of_shared_prefix_change_only_what_they_name() {
        let mut size = size();
        size.requests = 300;
        let varied = generate(WorkloadKind::VariedOutput, size, 4, tokenizer()).unwrap();
        let plain = generate(WorkloadKind::SharedPrefix, size, 4, tokenizer()).unwrap();
        let spread = |c: &[Conversation]| {
            let lengths: Vec<f64> = c.iter().map(|c| c.turns[0].output_tokens as f64).collect();
            let mean = lengths.iter().sum::<f64>() / lengths.len() as f64;
            (lengths.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / lengths.len() as f64).sqrt()
                / mean
        };
        assert!(
            spread(&varied) > 1.5 * spread(&plain),
            "{} {}",
            spread(&varied),
            spread(&plain)
        );
        assert_eq!(WorkloadKind::Bursty.burst(&size), 4);
        assert_eq!(WorkloadKind::SharedPrefix.burst(&size), 1);
        assert_eq!(
            WorkloadKind::Heterogeneous.worker_speeds(4),
            Some(vec![1.0, 1.0, 1.5, 1.0])
        );
        assert_eq!(WorkloadKind::NoShared.worker_speeds(4), None);
    }
}
