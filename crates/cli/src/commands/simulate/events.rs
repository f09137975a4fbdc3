//! What happened during the race, and when: the record both workers write to.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

/// One step of the race.
#[derive(Clone, Debug)]
pub enum What {
    /// A worker took the lock.
    Acquired {
        /// Its fence token.
        token: i64,
        /// Its lease TTL.
        ttl: Duration,
    },
    /// A worker read the row: claimed it with its token (fenced), or a plain read.
    Read {
        /// The token it claimed the row with; `None` for an unfenced read.
        claimed_with: Option<i64>,
        /// The row's status.
        status: String,
        /// Who the row says paid.
        paid_by: String,
    },
    /// Worker A stalls for this long.
    Pause(Duration),
    /// A's lease runs out (recorded by A at acquire time, for when it happens).
    Expired,
    /// Worker A resumes.
    Wake,
    /// A worker wrote the row, or tried to: one step of its job.
    Write {
        /// Which step of the job (1: processing, 2: paid).
        step: u8,
        /// What it set, in words (`status = paid, paid_by = B`).
        set: String,
        /// The token it wrote with; `None` for an unfenced write.
        token: Option<i64>,
        /// Whether Postgres applied it.
        applied: bool,
        /// What Postgres answered.
        detail: String,
    },
    /// A worker recorded the charge in the effect ledger before calling (fenced runs).
    Effect {
        /// The idempotency key the ledger gave it.
        key: String,
        /// How many leases have recorded the charge (1: this one is the first).
        holders: i32,
    },
    /// A worker calls the payment provider between its two writes (with the ledger's
    /// idempotency key in fenced runs, without one unfenced).
    Call {
        /// The `Idempotency-Key` it sends.
        key: Option<String>,
        /// How long the provider takes to charge.
        took: Duration,
    },
    /// The payment provider answered a worker's call.
    Answer {
        /// The HTTP status.
        status: u16,
        /// The charge id, when it charged or replayed a charge.
        charge: Option<String>,
        /// Whether it replayed an earlier answer for the same key (nothing charged).
        replayed: bool,
    },
    /// A worker recorded the call's outcome in the effect ledger (the charge id).
    Outcome(String),
    /// A worker gave up its job: a newer lease owns the row.
    FencedOut,
    /// A worker released the lock; what Redis answered.
    Released(&'static str),
}

/// A step, when it happened and who took it: `A`, `B`, or `-` for Redis.
#[derive(Clone, Debug)]
pub struct Event {
    /// Time since the race started.
    pub at: Duration,
    /// `A`, `B`, or `-` for Redis.
    pub actor: char,
    /// The step.
    pub what: What,
}

/// Collects events from both workers, timed from one start.
#[derive(Clone)]
pub struct Recorder {
    /// When the race started.
    pub t0: Instant,
    events: Arc<Mutex<Vec<Event>>>,
}

impl Recorder {
    /// A recorder whose clock starts now.
    pub fn start() -> Self {
        Self {
            t0: Instant::now(),
            events: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// Records `what` by `actor`, now.
    pub fn record(&self, actor: char, what: What) {
        let at = self.t0.elapsed();
        self.events
            .lock()
            .expect("recorder lock")
            .push(Event { at, actor, what });
    }

    /// Records `what` by `actor` at `at` (which may be in the future).
    pub fn record_at(&self, at: Duration, actor: char, what: What) {
        self.events
            .lock()
            .expect("recorder lock")
            .push(Event { at, actor, what });
    }

    /// Every event so far, in time order.
    pub fn sorted(&self) -> Vec<Event> {
        let mut events = self.events.lock().expect("recorder lock").clone();
        events.sort_by_key(|e| e.at);
        events
    }
}
