//! One request's accounting series: (tenant, model, target), resolved when the request is
//! planned, added to when it ends.

use super::*;

/// The request series seen so far, by the hash of their labels, so a lookup needs no owned key.
#[derive(Debug, Default)]
pub(super) struct SeriesCache {
    pub(super) by_hash: HashMap<u64, Vec<Arc<RequestSeries>>>,
    pub(super) len: usize,
}

impl SeriesCache {
    pub(super) fn find(
        &self,
        hash: u64,
        tenant: &str,
        model: &str,
        target: &str,
    ) -> Option<&Arc<RequestSeries>> {
        self.by_hash.get(&hash)?.iter().find(|series| {
            series.tenant == tenant && series.model == model && series.target == target
        })
    }
}

/// How a request that reached a target ended.
#[derive(Debug, Clone, Copy)]
pub struct Finished {
    /// The status sent to the client (0: none).
    pub status: u16,
    pub usage: Usage,
    /// Time to the first byte sent to the client.
    pub ttft: Option<Duration>,
    pub total: Duration,
}

/// The accounting series of one (tenant, model, target): what a request adds to when it ends.
/// The series of each outcome, and the latency histograms, are created with the first request
/// that needs them, so only what happened shows on `/metrics`.
#[derive(Debug)]
pub struct RequestSeries {
    pub(super) tenant: String,
    model: String,
    target: String,
    families: Arc<TenantFamilies>,
    success: OnceLock<OutcomeCounters>,
    client_error: OnceLock<OutcomeCounters>,
    upstream_error: OnceLock<OutcomeCounters>,
    aborted: OnceLock<OutcomeCounters>,
    ttft: OnceLock<Histogram>,
    duration: OnceLock<Histogram>,
}

/// The counters of one (tenant, model, target, outcome).
#[derive(Debug)]
struct OutcomeCounters {
    requests: Counter,
    prompt_tokens: Counter,
    cached_prompt_tokens: Counter,
    completion_tokens: Counter,
}

impl RequestSeries {
    pub(super) fn new(
        families: Arc<TenantFamilies>,
        tenant: &str,
        model: &str,
        target: &str,
    ) -> Self {
        RequestSeries {
            tenant: tenant.to_owned(),
            model: model.to_owned(),
            target: target.to_owned(),
            families,
            success: OnceLock::new(),
            client_error: OnceLock::new(),
            upstream_error: OnceLock::new(),
            aborted: OnceLock::new(),
            ttft: OnceLock::new(),
            duration: OnceLock::new(),
        }
    }

    /// Count a request that ended.
    pub fn finished(&self, request: &Finished) {
        let counters = self.outcome(request.status);
        counters.requests.inc();
        counters.prompt_tokens.inc_by(request.usage.prompt_tokens);
        counters
            .cached_prompt_tokens
            .inc_by(request.usage.cached_tokens);
        counters
            .completion_tokens
            .inc_by(request.usage.completion_tokens);
        if let Some(ttft) = request.ttft
            && (200..300).contains(&request.status)
        {
            self.latency(&self.ttft, &self.families.ttft)
                .observe(ttft.as_secs_f64());
        }
        self.latency(&self.duration, &self.families.duration)
            .observe(request.total.as_secs_f64());
    }

    fn outcome(&self, status: u16) -> &OutcomeCounters {
        let (cell, outcome) = match status {
            200..=299 => (&self.success, "success"),
            400..=499 => (&self.client_error, "client_error"),
            500..=599 => (&self.upstream_error, "upstream_error"),
            _ => (&self.aborted, "aborted"),
        };
        cell.get_or_init(|| {
            let labels = RequestLabels {
                tenant: self.tenant.clone(),
                model: self.model.clone(),
                target: self.target.clone(),
                outcome,
            };
            let families = &self.families;
            OutcomeCounters {
                requests: families.requests.get_or_create_owned(&labels),
                prompt_tokens: families.prompt_tokens.get_or_create_owned(&labels),
                cached_prompt_tokens: families.cached_prompt_tokens.get_or_create_owned(&labels),
                completion_tokens: families.completion_tokens.get_or_create_owned(&labels),
            }
        })
    }

    fn latency<'a>(&self, cell: &'a OnceLock<Histogram>, family: &LatencyFamily) -> &'a Histogram {
        cell.get_or_init(|| {
            family.get_or_create_owned(&LatencyLabels {
                tenant: self.tenant.clone(),
                model: self.model.clone(),
            })
        })
    }
}
