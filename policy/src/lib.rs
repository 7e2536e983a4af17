//! Prompt classification and the compiled `InferencePolicy` evaluator.
//!
//! Build an [`Evaluator`] once per snapshot ([`Evaluator::new`]), then call
//! [`Evaluator::evaluate`] per request with the request's facts and a [`Context`] that supplies
//! what is costly to know (the prompt's classes, a pool's live state) only when a rule asks.
//! The proxy and `switchyard-control explain` run exactly this code.

pub mod classify;
pub mod evaluate;
pub mod request;

pub use classify::{ClassId, ClassSet, Classifier, PromptText, Segments};
pub use evaluate::{
    Context, Decision, Evaluator, NoTarget, Outcome, PoolState, RequestFacts, Targets, TraceStep,
    targets,
};
pub use request::RequestPrompt;
