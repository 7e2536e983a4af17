//! Which worker holds which stored response.
//!
//! vLLM keeps a Responses API answer in the memory of the server that produced it
//! (`VLLM_ENABLE_RESPONSES_API_STORE=1`): a later `previous_response_id`, `GET` or `DELETE
//! /v1/responses/{id}` or `POST .../cancel` only works on that server. The gateway notes the
//! worker of every response id it forwards (at `response.created`, or when a whole answer ends)
//! and sends what names the id there. The map is bounded (oldest forgotten first) and entries
//! expire; an id it does not know is answered with a 404 that says so. Each gateway replica has
//! its own map: clients of several replicas must keep a conversation on one (see DESIGN).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use switchyard_snapshot::snapshot::Backend;

/// Where a response lives, and whose it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The pool (or provider, which keeps its own responses) that answered.
    pub backend: Backend,
    /// The pool's worker that answered, by HTTP address (`host:port`).
    pub worker: Option<String>,
    /// The tenant that created it: no other tenant may reach it.
    pub tenant: Option<String>,
    /// The model as the client named it (answers keep that name), and as the pool serves it.
    pub client_model: String,
    pub upstream_model: String,
}

/// What the directory knows of a response id for one tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The tenant's own: where it is.
    Mine(Holder),
    /// Another tenant's (live): to this tenant, as if unknown.
    Foreign,
    /// Never noted, expired or forgotten.
    Unknown,
}

/// Bounded, expiring map of response id → [`Holder`].
#[derive(Debug)]
pub struct ResponseDirectory {
    capacity: usize,
    ttl: Duration,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    by_id: HashMap<String, (Holder, Instant)>,
    /// Ids in the order they were noted (an id noted again appears twice; the older entry is
    /// skipped when it comes up).
    order: VecDeque<(String, Instant)>,
}

impl Default for ResponseDirectory {
    fn default() -> ResponseDirectory {
        ResponseDirectory::new(100_000, Duration::from_secs(24 * 3600))
    }
}

impl ResponseDirectory {
    pub fn new(capacity: usize, ttl: Duration) -> ResponseDirectory {
        ResponseDirectory {
            capacity: capacity.max(1),
            ttl,
            inner: Mutex::default(),
        }
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Note that `holder` has response `id`. An id another tenant's live response already has
    /// is not taken over (clients may choose ids: vLLM's `request_id`); `false` then.
    pub fn record(&self, id: &str, holder: Holder) -> bool {
        self.record_at(id, holder, Instant::now())
    }

    fn record_at(&self, id: &str, holder: Holder, now: Instant) -> bool {
        let mut inner = self.lock();
        if let Some((held, at)) = inner.by_id.get(id)
            && held.tenant != holder.tenant
            && now.saturating_duration_since(*at) < self.ttl
        {
            return false;
        }
        inner.by_id.insert(id.to_owned(), (holder, now));
        inner.order.push_back((id.to_owned(), now));
        // Ids noted again or forgotten leave stale places in line: drop them when they pile up.
        if inner.order.len() > 2 * self.capacity + 64 {
            let Inner { by_id, order } = &mut *inner;
            order.retain(|(id, at)| by_id.get(id).is_some_and(|(_, noted)| noted == at));
        }
        // Forget the expired, and the oldest beyond the capacity.
        while let Some((oldest, at)) = inner.order.front().cloned() {
            let live = inner
                .by_id
                .get(&oldest)
                .is_some_and(|(_, noted)| *noted == at);
            let expired = now.saturating_duration_since(at) >= self.ttl;
            if live && !expired && inner.by_id.len() <= self.capacity {
                break;
            }
            inner.order.pop_front();
            if live {
                inner.by_id.remove(&oldest);
            }
        }
        true
    }

    /// What the directory knows of `id` for `tenant`.
    pub fn lookup(&self, id: &str, tenant: Option<&str>) -> Lookup {
        self.lookup_at(id, tenant, Instant::now())
    }

    fn lookup_at(&self, id: &str, tenant: Option<&str>, now: Instant) -> Lookup {
        let inner = self.lock();
        match inner.by_id.get(id) {
            Some((holder, at)) if now.saturating_duration_since(*at) < self.ttl => {
                if holder.tenant.as_deref() == tenant {
                    Lookup::Mine(holder.clone())
                } else {
                    Lookup::Foreign
                }
            }
            _ => Lookup::Unknown,
        }
    }

    /// The holder of `id` for `tenant` (`None`: unknown, expired, or another tenant's).
    pub fn find(&self, id: &str, tenant: Option<&str>) -> Option<Holder> {
        match self.lookup(id, tenant) {
            Lookup::Mine(holder) => Some(holder),
            _ => None,
        }
    }

    #[cfg(test)]
    fn find_at(&self, id: &str, tenant: Option<&str>, now: Instant) -> Option<Holder> {
        match self.lookup_at(id, tenant, now) {
            Lookup::Mine(holder) => Some(holder),
            _ => None,
        }
    }

    /// Forget `id` (it was deleted on its worker).
    pub fn forget(&self, id: &str) {
        self.lock().by_id.remove(id);
    }

    pub fn len(&self) -> usize {
        self.lock().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(worker: &str, tenant: Option<&str>) -> Holder {
        Holder {
            backend: Backend::Pool(switchyard_snapshot::PoolId::new("default", "p")),
            worker: Some(worker.into()),
            tenant: tenant.map(str::to_owned),
            client_model: "alias".into(),
            upstream_model: "org/m".into(),
        }
    }

    #[test]
    fn finds_only_for_the_tenant_that_created_it_until_it_expires() {
        let directory = ResponseDirectory::new(10, Duration::from_secs(60));
        let start = Instant::now();
        directory.record_at("resp_1", holder("w1:8000", Some("team-a")), start);
        assert_eq!(
            directory
                .find_at("resp_1", Some("team-a"), start)
                .and_then(|h| h.worker),
            Some("w1:8000".to_owned())
        );
        assert_eq!(directory.find_at("resp_1", Some("team-b"), start), None);
        assert_eq!(
            directory.lookup_at("resp_1", Some("team-b"), start),
            Lookup::Foreign
        );
        assert_eq!(
            directory.lookup_at("resp_x", Some("team-b"), start),
            Lookup::Unknown
        );
        // Another tenant cannot take a live id over (clients may choose ids).
        assert!(!directory.record_at("resp_1", holder("w9:8000", Some("team-b")), start));
        assert_eq!(
            directory
                .find_at("resp_1", Some("team-a"), start)
                .and_then(|h| h.worker),
            Some("w1:8000".to_owned())
        );
        assert_eq!(directory.find_at("resp_1", None, start), None);
        assert_eq!(directory.find_at("resp_2", Some("team-a"), start), None);
        let later = start + Duration::from_secs(61);
        assert_eq!(directory.find_at("resp_1", Some("team-a"), later), None);
        // The next note sweeps it out.
        directory.record_at("resp_2", holder("w2:8000", None), later);
        assert_eq!(directory.len(), 1);
        directory.forget("resp_2");
        assert!(directory.is_empty());
    }

    #[test]
    fn keeps_the_newest_within_its_capacity() {
        let directory = ResponseDirectory::new(3, Duration::from_secs(60));
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        for n in 0..5 {
            directory.record_at(&format!("resp_{n}"), holder("w", None), at(n));
        }
        let now = at(10);
        assert_eq!(directory.len(), 3);
        assert_eq!(directory.find_at("resp_1", None, now), None);
        assert!(directory.find_at("resp_4", None, now).is_some());
        // Noted again: the id stays, its older place in line does not evict it.
        directory.record_at("resp_2", holder("w9", None), at(5));
        directory.record_at("resp_5", holder("w", None), at(6));
        assert_eq!(
            directory
                .find_at("resp_2", None, now)
                .and_then(|h| h.worker),
            Some("w9".to_owned())
        );
        assert_eq!(directory.len(), 3);
        // Places in line left by ids noted again do not pile up.
        for n in 0..1000 {
            directory.record_at("resp_5", holder("w", None), at(7 + n));
        }
        assert!(directory.lock().order.len() <= 2 * 3 + 64 + 1);
    }
}
