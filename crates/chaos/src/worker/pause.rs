//! The injected stalls: where a unit's [`Pause`] falls (before the read or the write, before
//! a script's statement, before a step of the effects job), and how it is drawn.

use std::time::Duration;

use rand::Rng;

use crate::util::millis;

use super::Worker;

/// The stall a unit injects into its first try.
#[derive(Clone, Copy)]
pub(super) enum Pause {
    None,
    BeforeRead(Duration),
    BeforeWrite(Duration),
    /// Before statement `n` of a multi-statement unit (counted over the whole script): between
    /// two transactions when it starts one, inside one otherwise.
    BeforeOp(usize, Duration),
    /// Effects modes: before this step of the job.
    Effect(StallBefore, Duration),
}

/// Which step of the effects job a stall comes before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum StallBefore {
    /// Before the claim (a zombie whose claim meets a newer lease's, or goes through).
    Claim,
    /// Between the committed claim and the ledger's begin (a zombie refused by the begin).
    Begin,
    /// Between the ledger's begin and the provider call: the dangerous spot, where the zombie
    /// calls late with the work item already taken over.
    Call,
    /// Between the provider's answer and the outcome's transaction (a zombie that charged
    /// and is refused by the finish; the holder that took over gets the replay).
    Finish,
}

impl Pause {
    pub(super) fn before_op(self, n: usize) -> Option<Duration> {
        match self {
            Pause::BeforeOp(at, d) if at == n => Some(d),
            _ => None,
        }
    }

    pub(super) fn before_read(self) -> Option<Duration> {
        match self {
            Pause::BeforeRead(d) => Some(d),
            _ => None,
        }
    }

    pub(super) fn before_write(self) -> Option<Duration> {
        match self {
            Pause::BeforeWrite(d) => Some(d),
            _ => None,
        }
    }

    pub(super) fn at(self, point: StallBefore) -> Option<Duration> {
        match self {
            Pause::Effect(p, d) if p == point => Some(d),
            _ => None,
        }
    }

    pub(super) fn length(self) -> Duration {
        match self {
            Pause::None => Duration::ZERO,
            Pause::BeforeRead(d)
            | Pause::BeforeWrite(d)
            | Pause::BeforeOp(_, d)
            | Pause::Effect(_, d) => d,
        }
    }
}

impl Worker {
    /// Decides whether this unit stalls, for how long, and where (`ops`: the statements of a
    /// multi-statement unit).
    pub(super) fn pick_pause(&mut self, ops: Option<usize>) -> Pause {
        let cfg = &self.ctx.cfg;
        if !self.rng.random_bool(cfg.pause_probability) {
            return Pause::None;
        }
        let lo = millis(cfg.pause_min);
        let hi = millis(cfg.pause_max).max(lo);
        let d = Duration::from_millis(self.rng.random_range(lo..=hi));
        self.out.stats.pauses += 1;
        if self.ctx.plan.effects.is_some() {
            // Most stalls at the dangerous spot, between recording the effect and the call.
            let point = match self.rng.random_range(0..10) {
                0 => StallBefore::Claim,
                1 | 2 => StallBefore::Begin,
                3 | 4 => StallBefore::Finish,
                _ => StallBefore::Call,
            };
            self.out.stats.stalls_before_call += u64::from(point == StallBefore::Call);
            return Pause::Effect(point, d);
        }
        if let Some(ops) = ops {
            return Pause::BeforeOp(self.rng.random_range(0..ops.max(1)), d);
        }
        if self.rng.random_bool(0.5) {
            Pause::BeforeRead(d)
        } else {
            Pause::BeforeWrite(d)
        }
    }
}

/// Sleeps for the injected stall, if any.
pub(super) async fn stall(pause: Option<Duration>) {
    if let Some(d) = pause {
        tokio::time::sleep(d).await;
    }
}
