//! Jepsen-style nemeses: network partitions between groups of workers and PostgreSQL, through
//! the testkit's loopback [`Proxy`], and steps of the lock server's wall clock (driven from
//! outside through a [`Control`], see [`clock_steps`]).
//!
//! # Partitions
//!
//! With [`Config::partitions`](crate::Config::partitions) set, the workers are split into
//! [`Partitions::groups`] groups (worker `w` is in group `w % groups`); each group reaches
//! PostgreSQL through its own proxy, with its own pool. About every [`Partitions::every`] the
//! nemesis picks one group and either
//!
//! * **black-holes** it for a while (drawn from [`Partitions::black_hole_min`] to
//!   [`Partitions::black_hole_max`]): the proxy stops forwarding in both directions, the
//!   connections stay open and the bytes wait ([`Proxy::pause`]) — a statement sent meanwhile
//!   arrives, or its reply comes back, only when the partition heals —
//!   [`Partitions::one_way_share`] of them in one direction only, a one-way partition
//!   ([`Proxy::pause_one_way`]: requests wait, or PostgreSQL runs them and its replies
//!   wait); or
//! * **resets** it ([`Partitions::reset_share`] of the partitions): every connection of the
//!   group is closed under its workers at once ([`Proxy::drop_connections`]); a statement in
//!   flight fails, and a `COMMIT` in flight has an unknown outcome.
//!
//! The other groups, and the issuer, are not affected: a worker cut off while it holds a
//! lease lets the lease run out, another group's worker takes the lock over, and the cut-off
//! worker's statements land after the partition heals — the zombie a fence must stop.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use pgfence_testkit::{Direction, Proxy};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::harness::{Control, Shared};
use crate::util::{lock, millis};

/// Partitions between groups of workers and PostgreSQL ([`Config::partitions`](crate::Config::partitions)).
#[derive(Clone, Debug)]
pub struct Partitions {
    /// Groups of workers, each with its own proxy and pool (worker `w` is in group
    /// `w % groups`). At least 1, at most the number of workers.
    pub groups: usize,
    /// Mean time from one partition's start to the next one's (drawn from half to one and a
    /// half times this).
    pub every: Duration,
    /// Shortest black-hole.
    pub black_hole_min: Duration,
    /// Longest black-hole.
    pub black_hole_max: Duration,
    /// The share of partitions that reset the group's connections instead of black-holing
    /// them (0: black-holes only, 1: resets only).
    pub reset_share: f64,
    /// The share of black-holes that stop one direction only (drawn half and half: requests
    /// to PostgreSQL, or its replies), a one-way partition ([`Proxy::pause_one_way`]); 0: all
    /// black-holes stop both directions.
    pub one_way_share: f64,
}

impl Default for Partitions {
    fn default() -> Self {
        Self {
            groups: 2,
            every: Duration::from_millis(400),
            black_hole_min: Duration::from_millis(100),
            black_hole_max: Duration::from_millis(300),
            reset_share: 0.3,
            one_way_share: 0.0,
        }
    }
}

impl Partitions {
    /// Checks the settings against the run's worker count.
    pub(crate) fn validate(&self, workers: usize) -> Result<(), String> {
        if self.groups == 0 || self.groups > workers {
            return Err("partitions: groups must be in 1..=workers".into());
        }
        if self.every.is_zero() {
            return Err("partitions: every must be positive".into());
        }
        if self.black_hole_min > self.black_hole_max {
            return Err("partitions: black_hole_min must not exceed black_hole_max".into());
        }
        if self.black_hole_max > Duration::from_secs(30) {
            return Err("partitions: black-holes of at most 30 s".into());
        }
        if !(0.0..=1.0).contains(&self.reset_share) {
            return Err("partitions: reset_share must be in 0..=1".into());
        }
        if !(0.0..=1.0).contains(&self.one_way_share) {
            return Err("partitions: one_way_share must be in 0..=1".into());
        }
        Ok(())
    }
}

/// One nemesis action, as it was applied.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NemesisEvent {
    /// `black_hole` (a group's connections stalled both ways), `one_way_to_server` /
    /// `one_way_to_client` (stalled in that direction only), `reset` (a group's connections
    /// closed) or `clock_step` (the lock server's wall clock stepped).
    pub kind: String,
    /// When it was applied (ms since the run started).
    pub at_ms: u64,
    /// The group of workers cut off (partitions), `None` for a clock step.
    pub group: Option<usize>,
    /// A black-hole's length in ms (0 for the others).
    pub duration_ms: u64,
    /// A clock step's size in ms (negative: backwards), and 0 for the partitions.
    pub step_ms: i64,
    /// A clock step: the server's clock offset from real time after it, in ms.
    pub offset_ms: i64,
}

/// What the nemeses did in a run ([`Summary::nemesis`](crate::Summary::nemesis)).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NemesisFigures {
    /// Groups of workers, each behind its own proxy (0: no partitions).
    pub groups: usize,
    /// Black-holes applied.
    pub black_holes: u64,
    /// Their total length, ms (one-way ones included).
    pub black_hole_ms: u64,
    /// Of the black-holes, those that stopped one direction only.
    pub one_way: u64,
    /// Resets applied.
    pub resets: u64,
    /// Clock steps applied.
    pub clock_steps: u64,
    /// The lock server's clock offset after the last step, ms.
    pub clock_offset_ms: i64,
}

impl NemesisFigures {
    /// The figures of `events` for a run with `groups` partition groups; `None` when there
    /// were no groups and no events.
    pub(crate) fn of(groups: usize, events: &[NemesisEvent]) -> Option<Self> {
        if groups == 0 && events.is_empty() {
            return None;
        }
        let mut f = NemesisFigures {
            groups,
            ..Self::default()
        };
        for e in events {
            match e.kind.as_str() {
                "black_hole" => {
                    f.black_holes += 1;
                    f.black_hole_ms += e.duration_ms;
                }
                "one_way_to_server" | "one_way_to_client" => {
                    f.black_holes += 1;
                    f.one_way += 1;
                    f.black_hole_ms += e.duration_ms;
                }
                "reset" => f.resets += 1,
                "clock_step" => {
                    f.clock_steps += 1;
                    f.clock_offset_ms = e.offset_ms;
                }
                _ => {}
            }
        }
        Some(f)
    }
}

/// Partitions one group at a time until the run ends (see the module's docs).
pub(crate) async fn partition(
    proxies: Arc<Vec<Proxy>>,
    plan: Partitions,
    shared: Arc<Shared>,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x6e65_6d65);
    let base = millis(plan.every).max(2);
    let (lo, hi) = (millis(plan.black_hole_min), millis(plan.black_hole_max));
    while !shared.done.load(Ordering::SeqCst) {
        let nap = rng.random_range(base / 2..=base + base / 2);
        tokio::time::sleep(Duration::from_millis(nap)).await;
        if shared.done.load(Ordering::SeqCst) || proxies.is_empty() {
            break;
        }
        let group = rng.random_range(0..proxies.len());
        let at_ms = shared.now_ms();
        let event = if rng.random_bool(plan.reset_share) {
            proxies[group].drop_connections();
            NemesisEvent {
                kind: "reset".into(),
                at_ms,
                group: Some(group),
                duration_ms: 0,
                step_ms: 0,
                offset_ms: 0,
            }
        } else {
            let ms = rng.random_range(lo..=hi);
            let kind = if rng.random_bool(plan.one_way_share) {
                let direction = if rng.random_bool(0.5) {
                    Direction::ToServer
                } else {
                    Direction::ToClient
                };
                proxies[group].pause_one_way(direction, Duration::from_millis(ms));
                match direction {
                    Direction::ToServer => "one_way_to_server",
                    Direction::ToClient => "one_way_to_client",
                }
            } else {
                proxies[group].pause(Duration::from_millis(ms));
                "black_hole"
            };
            NemesisEvent {
                kind: kind.into(),
                at_ms,
                group: Some(group),
                duration_ms: ms,
                step_ms: 0,
                offset_ms: 0,
            }
        };
        lock(&shared.nemesis).push(event);
    }
}

/// A lock server's wall clock that can be stepped (implemented for the testkit's
/// [`ShimmedRedis`](pgfence_testkit::clock::ShimmedRedis) and
/// [`ShimmedPostgres`](pgfence_testkit::clock::ShimmedPostgres)).
pub trait SteppableClock: Send + Sync {
    /// Moves the server's wall clock by `step_ms` (negative: backwards) and returns its offset
    /// from real time afterwards, in ms.
    ///
    /// # Errors
    /// The offset could not be changed.
    fn step_ms(&self, step_ms: i64) -> std::io::Result<i64>;
}

impl SteppableClock for pgfence_testkit::clock::ShimmedRedis {
    fn step_ms(&self, step_ms: i64) -> std::io::Result<i64> {
        self.clock()
            .step(Duration::from_millis(step_ms.unsigned_abs()), step_ms >= 0)
    }
}

impl SteppableClock for pgfence_testkit::clock::ShimmedPostgres {
    fn step_ms(&self, step_ms: i64) -> std::io::Result<i64> {
        self.clock()
            .step(Duration::from_millis(step_ms.unsigned_abs()), step_ms >= 0)
    }
}

/// Steps `clock` by `step_ms` about every `every` (half to one and a half times it, from
/// `seed`) while the run goes on, recording each step as a nemesis event of the run; the first
/// step comes once `after_units` units have started. Returns how many steps were applied
/// (the offset stays where it is: reset it if the server lives on).
pub async fn clock_steps(
    ctl: Control,
    clock: Arc<dyn SteppableClock>,
    after_units: u64,
    every: Duration,
    step_ms: i64,
    seed: u64,
) -> u64 {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x636c_6f63);
    let base = millis(every).max(2);
    if !ctl.wait_for_units(after_units).await {
        return 0;
    }
    let mut steps = 0;
    while !ctl.is_done() {
        if let Ok(offset_ms) = clock.step_ms(step_ms) {
            steps += 1;
            ctl.record_nemesis(NemesisEvent {
                kind: "clock_step".into(),
                at_ms: ctl.now_ms(),
                group: None,
                duration_ms: 0,
                step_ms,
                offset_ms,
            });
        }
        let nap = rng.random_range(base / 2..=base + base / 2);
        tokio::time::sleep(Duration::from_millis(nap)).await;
    }
    steps
}
