//! Seeded benchmark workloads: what the published cache-aware vs random comparison ran.
//!
//! - shared-prefix: groups of requests that share a long system prompt, each with a short unique
//!   question;
//! - multi-turn: conversations whose history grows turn by turn (a turn is sent only after the
//!   previous answer arrived);
//! - no-shared: unique prompts.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    SharedPrefix,
    MultiTurn,
    NoShared,
}

impl WorkloadKind {
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::SharedPrefix => "shared-prefix",
            WorkloadKind::MultiTurn => "multi-turn",
            WorkloadKind::NoShared => "no-shared",
        }
    }
}

/// Sizes of a workload, in words (the shipped tokenizer makes ~1.3 tokens of each).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct WorkloadSize {
    pub requests: usize,
    /// shared-prefix: groups of requests sharing one system prompt.
    pub groups: usize,
    /// Words of a shared system prompt (shared-prefix) or of a whole prompt (no-shared).
    pub prompt_words: usize,
    /// Words of each unique question / user turn.
    pub question_words: usize,
    /// multi-turn: turns per conversation (requests / turns conversations).
    pub turns: usize,
    /// Tokens generated per request.
    pub output_tokens: usize,
}

const WORDS: &[&str] = &[
    "system", "policy", "customer", "invoice", "network", "latency", "river", "mountain",
    "history", "quantum", "garden", "engine", "protocol", "harbor", "ledger", "signal", "crystal",
    "forest", "market", "theory", "window", "bridge", "planet", "archive", "module", "pattern",
    "vector", "kernel", "summer", "copper",
];

fn words(rng: &mut StdRng, count: usize) -> String {
    (0..count)
        .map(|_| {
            let word = WORDS
                .get(rng.random_range(0..WORDS.len()))
                .copied()
                .unwrap_or("word");
            format!("{word}{}", rng.random_range(0..1000))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// One conversation: the turns' user messages, sent one after another with the history growing.
/// Single-request workloads are conversations of one turn.
#[derive(Debug, Clone)]
pub struct Conversation {
    pub system: Option<String>,
    pub turns: Vec<String>,
}

impl Conversation {
    /// The chat body of turn `turn`, given the answers to the earlier turns.
    pub fn request(
        &self,
        model: &str,
        turn: usize,
        answers: &[String],
        output_tokens: usize,
    ) -> Value {
        let mut messages = Vec::new();
        if let Some(system) = &self.system {
            messages.push(json!({"role": "system", "content": system}));
        }
        for (index, user) in self.turns.iter().take(turn + 1).enumerate() {
            messages.push(json!({"role": "user", "content": user}));
            if index < turn {
                messages.push(json!({"role": "assistant", "content": answers.get(index).cloned().unwrap_or_default()}));
            }
        }
        json!({
            "model": model,
            "messages": messages,
            "max_tokens": output_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    }
}

/// Conversations in the order they start.
pub fn generate(kind: WorkloadKind, size: WorkloadSize, seed: u64) -> Vec<Conversation> {
    let mut rng = StdRng::seed_from_u64(seed);
    match kind {
        WorkloadKind::SharedPrefix => {
            let systems: Vec<String> = (0..size.groups.max(1))
                .map(|_| words(&mut rng, size.prompt_words))
                .collect();
            let mut conversations: Vec<Conversation> = (0..size.requests)
                .map(|i| Conversation {
                    system: systems.get(i % systems.len()).cloned(),
                    turns: vec![words(&mut rng, size.question_words)],
                })
                .collect();
            conversations.shuffle(&mut rng);
            conversations
        }
        WorkloadKind::MultiTurn => {
            let turns = size.turns.max(1);
            (0..size.requests.div_ceil(turns))
                .map(|_| Conversation {
                    system: Some(words(&mut rng, size.question_words)),
                    turns: (0..turns)
                        .map(|_| words(&mut rng, size.question_words * 4))
                        .collect(),
                })
                .collect()
        }
        WorkloadKind::NoShared => (0..size.requests)
            .map(|_| Conversation {
                system: None,
                turns: vec![words(&mut rng, size.prompt_words)],
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size() -> WorkloadSize {
        WorkloadSize {
            requests: 12,
            groups: 3,
            prompt_words: 50,
            question_words: 5,
            turns: 4,
            output_tokens: 8,
        }
    }

    #[test]
    fn workloads_are_seeded_and_shaped() {
        let shared = generate(WorkloadKind::SharedPrefix, size(), 7);
        assert_eq!(shared.len(), 12);
        let systems: std::collections::HashSet<_> =
            shared.iter().map(|c| c.system.clone()).collect();
        assert_eq!(systems.len(), 3);
        let again = generate(WorkloadKind::SharedPrefix, size(), 7);
        assert_eq!(shared[0].turns, again[0].turns);

        let multi = generate(WorkloadKind::MultiTurn, size(), 7);
        assert_eq!(multi.len(), 3);
        let third = multi[0].request("m", 2, &["a0".into(), "a1".into()], 8);
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

        let unique = generate(WorkloadKind::NoShared, size(), 7);
        assert!(
            unique
                .iter()
                .all(|c| c.system.is_none() && c.turns.len() == 1)
        );
    }
}
