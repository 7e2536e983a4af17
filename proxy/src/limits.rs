//! Per-tenant rate limits: requests per minute, tokens per minute, requests in flight.
//!
//! Each limit is a token bucket that refills continuously (a full minute's allowance at most),
//! so bursts up to the per-minute figure pass and sustained traffic is held to the rate.
//! Tokens are reserved when a request is admitted, at the most it can cost: the prompt estimated
//! from the body's size plus its `max_tokens` (or [`DEFAULT_RESERVED_COMPLETION_TOKENS`] when it
//! sets none), so concurrent requests cannot overshoot the limit together. When the answer's usage
//! is known the reservation is settled to what was really used; a request that ends without
//! usage gives its completion reservation back and keeps its prompt estimate charged (the
//! upstream may have computed it). A request larger than the whole allowance waits for a full
//! bucket; while in flight it holds its prompt and at most a full bucket of completion (a
//! `max_tokens` past any model's context would otherwise lock its tenant out for ages, until
//! the worker refuses it), and it settles to what it used. Limits are per proxy process (see the
//! README on several replicas). Time is tokio's, so tests drive it with a paused clock.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use switchyard_snapshot::snapshot::RateLimits;
use tokio::time::Instant;

/// A continuously refilling allowance of `capacity` per minute.
#[derive(Debug)]
struct Bucket {
    capacity: f64,
    /// May go negative when completion tokens are settled after the fact.
    available: f64,
    updated: Instant,
}

impl Bucket {
    fn new(capacity: u64, now: Instant) -> Bucket {
        Bucket {
            capacity: capacity as f64,
            available: capacity as f64,
            updated: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.available = (self.available + elapsed * self.capacity / 60.0).min(self.capacity);
        self.updated = now;
    }

    /// Time until `amount` is available (zero when it is now).
    fn wait_for(&self, amount: f64) -> Duration {
        let missing = amount.min(self.capacity) - self.available;
        if missing <= 0.0 {
            Duration::ZERO
        } else {
            // A bucket overdrawn by answers settled after the fact can be far below zero; the
            // wait saturates rather than overflow a Duration.
            Duration::try_from_secs_f64(missing * 60.0 / self.capacity).unwrap_or(Duration::MAX)
        }
    }

    fn resize(&mut self, capacity: u64) {
        let capacity = capacity as f64;
        self.available = self.available.min(capacity);
        self.capacity = capacity;
    }
}

#[derive(Debug, Default)]
struct TenantState {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    in_flight: u32,
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    RequestsPerMinute,
    TokensPerMinute,
    Concurrency,
}

impl Limit {
    pub fn label(self) -> &'static str {
        match self {
            Limit::RequestsPerMinute => "requests_per_minute",
            Limit::TokensPerMinute => "tokens_per_minute",
            Limit::Concurrency => "concurrency",
        }
    }
}

/// A refusal: which limit, its value, and when to retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub limit: Limit,
    pub value: u64,
    pub retry_after: Duration,
}

impl Refusal {
    /// Whole seconds for `Retry-After` (at least 1).
    pub fn retry_after_secs(&self) -> u64 {
        self.retry_after.as_secs_f64().ceil().max(1.0) as u64
    }

    pub fn message(&self, tenant: &str) -> String {
        match self.limit {
            Limit::RequestsPerMinute => format!(
                "rate limit reached for tenant '{tenant}': {} requests per minute; retry after {} s",
                self.value,
                self.retry_after_secs()
            ),
            Limit::TokensPerMinute => format!(
                "rate limit reached for tenant '{tenant}': {} tokens per minute; retry after {} s",
                self.value,
                self.retry_after_secs()
            ),
            Limit::Concurrency => format!(
                "too many concurrent requests for tenant '{tenant}': at most {} at a time; retry when one finishes",
                self.value
            ),
        }
    }
}

/// Limits of every tenant, kept across snapshots (a reload does not refill buckets).
#[derive(Debug, Default)]
pub struct RateLimiter {
    tenants: Mutex<HashMap<String, TenantState>>,
}

/// Completion tokens reserved for a request that sets no `max_tokens`.
pub const DEFAULT_RESERVED_COMPLETION_TOKENS: u64 = 1_024;

/// The most a request can cost, reserved when it is admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    /// Estimated from the body (see [`estimate_prompt_tokens`]).
    pub prompt_tokens: u64,
    /// `max_tokens`, or [`DEFAULT_RESERVED_COMPLETION_TOKENS`].
    pub completion_tokens: u64,
}

impl Reservation {
    pub fn for_request(body_len: usize, max_tokens: Option<u64>) -> Reservation {
        Reservation {
            prompt_tokens: estimate_prompt_tokens(body_len),
            completion_tokens: max_tokens.unwrap_or(DEFAULT_RESERVED_COMPLETION_TOKENS),
        }
    }

    fn total(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.completion_tokens)
    }
}

/// An admitted request: holds its concurrency slot and its token reservation until settled.
#[derive(Debug)]
pub struct Admission {
    limiter: Arc<RateLimiter>,
    tenant: String,
    limits: RateLimits,
    /// What the request reserved, or settled to.
    charged: Reservation,
    /// What the tokens bucket holds for it now: the prompt and at most a full bucket of
    /// completion, until settled to what it really used.
    charged_tokens: u64,
    settled: bool,
    holds_slot: bool,
}

impl RateLimiter {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, TenantState>> {
        crate::lock(&self.tenants)
    }

    /// Admit a request of `tenant` reserving `reservation`, or say which limit refuses it and
    /// for how long. Nothing is taken from any bucket on refusal.
    pub fn admit(
        self: &Arc<Self>,
        tenant: &str,
        limits: RateLimits,
        reservation: Reservation,
    ) -> Result<Admission, Refusal> {
        let now = Instant::now();
        let mut tenants = self.lock();
        let state = tenants.entry(tenant.to_owned()).or_default();
        sync_bucket(
            &mut state.requests,
            limits.requests_per_minute.map(u64::from),
            now,
        );
        sync_bucket(&mut state.tokens, limits.tokens_per_minute, now);
        if let Some(max) = limits.concurrency
            && state.in_flight >= max
        {
            return Err(Refusal {
                limit: Limit::Concurrency,
                value: u64::from(max),
                retry_after: Duration::from_secs(1),
            });
        }
        if let Some(bucket) = &state.requests {
            let wait = bucket.wait_for(1.0);
            if !wait.is_zero() {
                return Err(Refusal {
                    limit: Limit::RequestsPerMinute,
                    value: bucket.capacity as u64,
                    retry_after: wait,
                });
            }
        }
        if let Some(bucket) = &state.tokens {
            // A request larger than the whole allowance waits for a full bucket, not forever.
            let wait = bucket.wait_for(reservation.total().max(1) as f64);
            if !wait.is_zero() {
                return Err(Refusal {
                    limit: Limit::TokensPerMinute,
                    value: bucket.capacity as u64,
                    retry_after: wait,
                });
            }
        }
        if let Some(bucket) = &mut state.requests {
            bucket.available -= 1.0;
        }
        let charged_tokens = match &mut state.tokens {
            Some(bucket) => {
                let charge = reservation
                    .prompt_tokens
                    .saturating_add(reservation.completion_tokens.min(bucket.capacity as u64));
                bucket.available -= charge as f64;
                charge
            }
            None => 0,
        };
        let holds_slot = limits.concurrency.is_some();
        if holds_slot {
            state.in_flight += 1;
        }
        Ok(Admission {
            limiter: self.clone(),
            tenant: tenant.to_owned(),
            limits,
            charged: reservation,
            charged_tokens,
            settled: false,
            holds_slot,
        })
    }
}

fn sync_bucket(bucket: &mut Option<Bucket>, limit: Option<u64>, now: Instant) {
    match (bucket.as_mut(), limit) {
        (_, None) => *bucket = None,
        (None, Some(capacity)) => *bucket = Some(Bucket::new(capacity, now)),
        (Some(existing), Some(capacity)) => {
            existing.refill(now);
            if existing.capacity as u64 != capacity {
                existing.resize(capacity);
            }
        }
    }
}

impl Admission {
    /// Settle the tokens the answer really used: the prompt as the upstream counted it and the
    /// completion replace the reservation.
    pub fn settle(&mut self, prompt_tokens: u64, completion_tokens: u64) {
        self.recharge(Reservation {
            prompt_tokens,
            completion_tokens,
        });
        self.settled = true;
    }

    /// Charge `now` instead of what is charged.
    fn recharge(&mut self, now: Reservation) {
        if self.limits.tokens_per_minute.is_some() {
            let mut tenants = self.limiter.lock();
            if let Some(bucket) = tenants
                .get_mut(&self.tenant)
                .and_then(|state| state.tokens.as_mut())
            {
                bucket.refill(Instant::now());
                // What comes back fills the bucket at most (it may have refilled meanwhile).
                bucket.available = (bucket.available + self.charged_tokens as f64
                    - now.total() as f64)
                    .min(bucket.capacity);
            }
        }
        self.charged = now;
        self.charged_tokens = now.total();
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if !self.settled && self.charged.completion_tokens > 0 {
            // Ended without usage (an error, a cancelled request): nothing was generated that
            // we know of; the prompt estimate stays charged.
            self.recharge(Reservation {
                completion_tokens: 0,
                ..self.charged
            });
        }
        if !self.holds_slot {
            return;
        }
        let mut tenants = self.limiter.lock();
        if let Some(state) = tenants.get_mut(&self.tenant) {
            state.in_flight = state.in_flight.saturating_sub(1);
        }
    }
}

/// Prompt tokens estimated from a request body before it is tokenized: about four bytes per
/// token of JSON text, which errs on the high side for English (the JSON syntax counts too).
pub fn estimate_prompt_tokens(body_len: usize) -> u64 {
    (body_len as u64).div_ceil(4)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request whose whole cost is its prompt (no completion reserved).
    fn prompt(tokens: u64) -> Reservation {
        Reservation {
            prompt_tokens: tokens,
            completion_tokens: 0,
        }
    }

    fn limits(rpm: Option<u32>, tpm: Option<u64>, concurrency: Option<u32>) -> RateLimits {
        RateLimits {
            requests_per_minute: rpm,
            tokens_per_minute: tpm,
            concurrency,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn requests_per_minute_refill_continuously() {
        let limiter = Arc::new(RateLimiter::default());
        let l = limits(Some(60), None, None);
        let admitted: Vec<_> = (0..60)
            .map(|_| limiter.admit("t", l, prompt(10)).unwrap())
            .collect();
        let refusal = limiter.admit("t", l, prompt(10)).unwrap_err();
        assert_eq!(refusal.limit, Limit::RequestsPerMinute);
        assert_eq!(refusal.retry_after, Duration::from_secs(1));
        assert_eq!(refusal.retry_after_secs(), 1);
        tokio::time::advance(Duration::from_millis(999)).await;
        assert!(limiter.admit("t", l, prompt(10)).is_err());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(limiter.admit("t", l, prompt(10)).is_ok());
        assert!(limiter.admit("t", l, prompt(10)).is_err());
        // Other tenants have their own buckets.
        assert!(limiter.admit("u", l, prompt(10)).is_ok());
        drop(admitted);
        // A minute refills the whole allowance, never more.
        tokio::time::advance(Duration::from_secs(600)).await;
        for _ in 0..60 {
            limiter.admit("t", l, prompt(10)).unwrap();
        }
        assert!(limiter.admit("t", l, prompt(10)).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn tokens_are_taken_up_front_and_settled_after() {
        let limiter = Arc::new(RateLimiter::default());
        let l = limits(None, Some(6_000), None);
        let mut first = limiter.admit("t", l, prompt(1_000)).unwrap();
        // The answer: the upstream counted 800 prompt tokens and produced 4_000.
        first.settle(800, 4_000);
        // 6000 - 4800 = 1200 left: a 1000-token prompt passes, a second one does not.
        limiter.admit("t", l, prompt(1_000)).unwrap();
        let refusal = limiter.admit("t", l, prompt(1_000)).unwrap_err();
        assert_eq!(refusal.limit, Limit::TokensPerMinute);
        // 200 available, 800 missing at 100 tokens/s: 8 s.
        assert_eq!(refusal.retry_after, Duration::from_secs(8));
        tokio::time::advance(Duration::from_secs(8)).await;
        limiter.admit("t", l, prompt(1_000)).unwrap();
        // A prompt over the whole allowance waits for a full bucket, then passes.
        tokio::time::advance(Duration::from_secs(60)).await;
        limiter.admit("t", l, prompt(50_000)).unwrap();
        let refusal = limiter.admit("t", l, prompt(1)).unwrap_err();
        assert!(refusal.retry_after > Duration::from_secs(60), "{refusal:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn concurrency_slots_are_released_when_requests_end() {
        let limiter = Arc::new(RateLimiter::default());
        let l = limits(None, None, Some(2));
        let a = limiter.admit("t", l, prompt(1)).unwrap();
        let _b = limiter.admit("t", l, prompt(1)).unwrap();
        let refusal = limiter.admit("t", l, prompt(1)).unwrap_err();
        assert_eq!(refusal.limit, Limit::Concurrency);
        assert!(refusal.message("t").contains("at most 2 at a time"));
        drop(a);
        let _c = limiter.admit("t", l, prompt(1)).unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn refusals_take_nothing_and_limits_follow_reloads() {
        let limiter = Arc::new(RateLimiter::default());
        let both = limits(Some(2), Some(100), None);
        limiter.admit("t", both, prompt(60)).unwrap();
        // Tokens refuse: the request bucket must not be charged for it.
        assert_eq!(
            limiter.admit("t", both, prompt(60)).unwrap_err().limit,
            Limit::TokensPerMinute
        );
        limiter.admit("t", both, prompt(40)).unwrap();
        assert_eq!(
            limiter.admit("t", both, prompt(0)).unwrap_err().limit,
            Limit::RequestsPerMinute
        );
        // Raising the limit keeps what was used; removing it lifts it.
        let raised = limits(Some(3), Some(100), None);
        assert!(
            limiter.admit("t", raised, prompt(0)).is_err(),
            "a raised cap does not refill"
        );
        tokio::time::advance(Duration::from_secs(20)).await;
        limiter.admit("t", raised, prompt(0)).unwrap();
        let none = limits(None, None, None);
        for _ in 0..100 {
            limiter.admit("t", none, prompt(1_000)).unwrap();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_requests_cannot_overshoot_the_token_limit_together() {
        let limiter = Arc::new(RateLimiter::default());
        let l = limits(None, Some(2_000), None);
        // 30 requests at once, each a ~20-token prompt asking for up to 500 tokens.
        let request = Reservation::for_request(80, Some(500));
        assert_eq!(request.prompt_tokens, 20);
        let outcomes: Vec<_> = (0..30).map(|_| limiter.admit("t", l, request)).collect();
        let mut admitted: Vec<Admission> = outcomes.into_iter().flatten().collect();
        // 3 × 520 fit in 2,000; a fourth would overshoot.
        assert_eq!(admitted.len(), 3);
        // They used far less than reserved: settling gives the rest back at once.
        for admission in &mut admitted {
            admission.settle(20, 100);
        }
        // 2,000 - 3 × 120 = 1,640 left: three more fit, no lock-out.
        for _ in 0..3 {
            admitted.push(limiter.admit("t", l, request).unwrap());
        }
        assert!(limiter.admit("t", l, request).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_reservation_past_the_allowance_holds_one_full_bucket() {
        let limiter = Arc::new(RateLimiter::default());
        let l = limits(None, Some(60), None);
        // `max_tokens` past any model's context: it waits for a full bucket and holds its
        // prompt and one bucket of completion, not 2^64 tokens that would lock the tenant out
        // (and overflow the wait).
        let huge = Reservation::for_request(40, Some(u64::MAX));
        let mut admitted = limiter.admit("t", l, huge).unwrap();
        let refusal = limiter.admit("t", l, prompt(1)).unwrap_err();
        assert_eq!(refusal.limit, Limit::TokensPerMinute);
        assert!(refusal.retry_after <= Duration::from_secs(60));
        // Settled to what it used: 10 tokens.
        admitted.settle(4, 6);
        let _ok = limiter.admit("t", l, prompt(50)).unwrap();
        assert!(limiter.admit("t", l, prompt(1)).is_err());
        // Settled after the bucket refilled: what comes back does not fill it past its size.
        let mut late = limiter.admit("v", l, huge).unwrap();
        tokio::time::advance(Duration::from_secs(120)).await;
        late.settle(4, 6);
        let _ok = limiter.admit("v", l, prompt(60)).unwrap();
        assert!(limiter.admit("v", l, prompt(1)).is_err());
        // An answer that used far more than the bucket holds overdraws it; the wait is long
        // but a number, not a panic.
        let mut big = limiter.admit("u", l, prompt(1)).unwrap();
        big.settle(1, u64::MAX);
        let refusal = limiter.admit("u", l, prompt(1)).unwrap_err();
        assert!(refusal.retry_after_secs() > 60);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_that_ends_without_usage_keeps_only_its_prompt_charged() {
        let limiter = Arc::new(RateLimiter::default());
        let l = limits(None, Some(1_000), None);
        let failed = limiter
            .admit(
                "t",
                l,
                Reservation {
                    prompt_tokens: 100,
                    completion_tokens: 800,
                },
            )
            .unwrap();
        assert!(limiter.admit("t", l, prompt(200)).is_err());
        drop(failed);
        // 1,000 - 100: the 800 completion tokens came back, the prompt estimate did not.
        let _ok = limiter.admit("t", l, prompt(900)).unwrap();
        assert!(limiter.admit("t", l, prompt(1)).is_err());
    }

    #[test]
    fn a_request_without_max_tokens_reserves_the_default() {
        let reservation = Reservation::for_request(400, None);
        assert_eq!(reservation.prompt_tokens, 100);
        assert_eq!(
            reservation.completion_tokens,
            DEFAULT_RESERVED_COMPLETION_TOKENS
        );
    }
}
