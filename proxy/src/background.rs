//! Work no request waits for, on a few threads of the lowest scheduling priority.
//!
//! Tokenizing the whole of a prompt that was routed by its head (`exchange::finish_prompt`)
//! readies the segment cache for what follows it, but nobody waits for it. At the priority of
//! the event loop it would share the cores with the requests in flight — their reading,
//! planning, forwarding and streaming — and, on a machine shared with workers, with their
//! tokenizers. Here it runs on what the rest leaves: Linux's niceness 19 (per thread on Linux).
//!
//! The queue is bounded: when it is full a job is dropped, not queued behind the others.

use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

type Job = Box<dyn FnOnce() + Send + 'static>;

/// Low-priority threads and their bounded queue.
pub struct Background {
    queue: SyncSender<Job>,
}

impl Background {
    /// `threads` threads named `name` taking jobs from a queue of `capacity`.
    pub fn start(name: &str, threads: usize, capacity: usize) -> std::io::Result<Background> {
        let (queue, jobs) = std::sync::mpsc::sync_channel::<Job>(capacity);
        let jobs = Arc::new(Mutex::new(jobs));
        for _ in 0..threads.max(1) {
            let jobs = jobs.clone();
            std::thread::Builder::new()
                .name(name.to_owned())
                .spawn(move || run(&jobs))?;
        }
        Ok(Background { queue })
    }

    /// Queue `job`; `false` (and the job dropped) when the queue is full.
    pub fn try_run(&self, job: impl FnOnce() + Send + 'static) -> bool {
        match self.queue.try_send(Box::new(job)) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
        }
    }
}

fn run(jobs: &Mutex<Receiver<Job>>) {
    if let Err(error) =
        thread_priority::set_current_thread_priority(thread_priority::ThreadPriority::Min)
    {
        // Still correct, only no longer out of the way.
        tracing::debug!(?error, "background thread keeps the normal priority");
    }
    loop {
        let job = match jobs.lock() {
            Ok(receiver) => receiver.recv(),
            Err(_) => return,
        };
        match job {
            // A job that panics costs itself, not the thread.
            Ok(job) => {
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                    tracing::warn!("a background job panicked");
                }
            }
            Err(_) => return,
        }
    }
}

/// The process's background threads for prompt work: two (the work is bounded by the queue,
/// not by the threads), with room for sixteen jobs.
pub fn prompts() -> Option<&'static Background> {
    static PROMPTS: std::sync::OnceLock<Option<Background>> = std::sync::OnceLock::new();
    PROMPTS
        .get_or_init(|| match Background::start("switchyard-prompts", 2, 16) {
            Ok(background) => Some(background),
            Err(error) => {
                tracing::warn!(%error, "no background threads for prompt work");
                None
            }
        })
        .as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;
    use std::time::Duration;

    /// The niceness of the calling thread, from Linux's /proc.
    fn own_niceness() -> Option<i32> {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
        // Fields after the command name in parentheses; niceness is the 19th field overall.
        let rest = stat.rsplit_once(')')?.1;
        rest.split_whitespace().nth(16)?.parse().ok()
    }

    #[test]
    fn jobs_run_at_the_lowest_priority() {
        let background = Background::start("test-background", 1, 4).unwrap();
        let (done, results) = channel();
        assert!(background.try_run(move || {
            done.send(own_niceness()).unwrap();
        }));
        let niceness = results.recv_timeout(Duration::from_secs(10)).unwrap();
        if cfg!(target_os = "linux") {
            assert_eq!(niceness, Some(19));
            // The caller's own thread is untouched.
            assert_ne!(own_niceness(), Some(19));
        }
    }

    #[test]
    fn a_job_that_panics_leaves_the_thread_working() {
        let background = Background::start("test-background", 1, 4).unwrap();
        assert!(background.try_run(|| panic!("a job that panics")));
        let (done, results) = channel();
        assert!(background.try_run(move || done.send(7).unwrap()));
        assert_eq!(results.recv_timeout(Duration::from_secs(10)), Ok(7));
    }

    #[test]
    fn a_full_queue_drops_the_job() {
        let background = Background::start("test-background", 1, 1).unwrap();
        let (release, gate) = channel::<()>();
        let (started, running) = channel();
        // The thread takes the first job and waits on the gate; the second fills the queue.
        assert!(background.try_run(move || {
            started.send(()).unwrap();
            let _ = gate.recv();
        }));
        running.recv_timeout(Duration::from_secs(10)).unwrap();
        let (ran, count) = channel();
        let second = ran.clone();
        assert!(background.try_run(move || second.send(2).unwrap()));
        assert!(!background.try_run(move || ran.send(3).unwrap()));
        release.send(()).unwrap();
        assert_eq!(count.recv_timeout(Duration::from_secs(10)).unwrap(), 2);
        // The dropped job never runs (its sender is gone with it).
        assert!(count.recv_timeout(Duration::from_millis(200)).is_err());
    }
}
