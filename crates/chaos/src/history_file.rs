//! The run's history as JSON lines, for a checker outside the project (the format is
//! documented in `docs/proof.md`, section "History format").
//!
//! One JSON object per line, each with a `type`: a `run` header first, then every
//! operation's `invoke` and `complete` events, the library `call`s, the `nemesis` actions and
//! the `fault` marks,
//! in time order, then one `final` line per counter row with the value PostgreSQL committed.

use std::io::Write;
use std::path::Path;

use serde_json::{Value, json};

use crate::{Attempt, Outcome, Report, Stage};

/// The `format` of the `run` header line; it changes when a field changes meaning.
pub const HISTORY_FORMAT_VERSION: u32 = 1;

/// A `complete` event's `outcome`: `ok` (committed and acknowledged), `stale` (refused by the
/// fence: nothing of that transaction committed), `unknown` (the `COMMIT` got no answer: it
/// may or may not have committed) or `error` (failed before `COMMIT`: that transaction did
/// not commit).
fn outcome_name(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Accepted => "ok",
        Outcome::Rejected { .. } => "stale",
        Outcome::Failed {
            stage: Stage::Commit,
            ..
        } => "unknown",
        Outcome::Failed { .. } => "error",
    }
}

/// The partition group of worker `worker` when the run had `groups` groups.
fn group_of(worker: usize, groups: usize) -> Value {
    if groups == 0 {
        Value::Null
    } else {
        json!(worker % groups)
    }
}

fn invoke(a: &Attempt, groups: usize) -> Value {
    json!({
        "type": "invoke",
        "time_ms": a.started_ms,
        "process": a.worker,
        "group": group_of(a.worker, groups),
        "lease": a.unit,
        "try": a.try_no,
        "token": a.token,
        "row": a.row,
        "lease_at_ms": a.lease_at_ms,
        "first_txn": a.first_txn,
    })
}

fn complete(a: &Attempt, groups: usize) -> Value {
    let mut event = json!({
        "type": "complete",
        "time_ms": a.finished_ms,
        "process": a.worker,
        "group": group_of(a.worker, groups),
        "lease": a.unit,
        "try": a.try_no,
        "token": a.token,
        "row": a.row,
        "outcome": outcome_name(&a.outcome),
        "value_read": a.value_read,
        "value_written": a.value_written,
        "commits": a.commits,
        "paused_ms": a.paused_ms,
    });
    if let Value::Object(map) = &mut event {
        match &a.outcome {
            Outcome::Accepted => {}
            Outcome::Rejected {
                current,
                by,
                duplicate,
                ..
            } => {
                map.insert("current".into(), json!(current));
                map.insert("by".into(), json!(by));
                map.insert("duplicate".into(), json!(duplicate));
            }
            Outcome::Failed {
                stage,
                retryable,
                error,
            } => {
                map.insert("stage".into(), json!(stage));
                map.insert("retryable".into(), json!(retryable));
                map.insert("error".into(), json!(error));
            }
        }
        if let Some(batch) = &a.batch {
            map.insert("batch".into(), json!(batch));
        }
    }
    event
}

impl Report {
    /// Writes the run's history as JSON lines to `out` (format: `docs/proof.md`, "History
    /// format"): a `run` header; each attempt's `invoke` (at its start) and `complete` (at its
    /// end) events, each library `call` (at its start), the `nemesis` actions and the `fault`
    /// marks, ordered by `time_ms` (an
    /// attempt's `invoke` before its `complete`); a `final` line per counter row.
    ///
    /// # Errors
    /// Writing to `out` failed.
    pub fn write_history(&self, mut out: impl Write) -> std::io::Result<()> {
        let s = &self.summary;
        let groups = s.nemesis.as_ref().map_or(0, |n| n.groups);
        let header = json!({
            "type": "run",
            "format": HISTORY_FORMAT_VERSION,
            "run": s.run,
            "mode": s.mode,
            "issuer": s.issuer,
            "workers": s.workers,
            "rows": s.rows,
            "groups": groups,
            "duration_ms": s.duration_ms,
        });
        writeln!(out, "{header}")?;
        // (time, rank, sequence): invoke 0 < nemesis 1 < fault 1 < complete 2 at equal times.
        let mut events: Vec<(u64, u8, usize, Value)> = Vec::new();
        for a in &self.attempts {
            events.push((a.started_ms, 0, events.len(), invoke(a, groups)));
            events.push((a.finished_ms, 2, events.len(), complete(a, groups)));
        }
        for n in &self.nemesis {
            let event = json!({
                "type": "nemesis",
                "time_ms": n.at_ms,
                "kind": n.kind,
                "group": n.group,
                "duration_ms": n.duration_ms,
                "step_ms": n.step_ms,
                "offset_ms": n.offset_ms,
            });
            events.push((n.at_ms, 1, events.len(), event));
        }
        for c in &self.calls {
            let event = json!({
                "type": "call",
                "time_ms": c.at_ms,
                "process": c.worker,
                "group": group_of(c.worker, groups),
                "op": c.op,
                "duration_us": c.duration_us,
                "bound_ms": c.bound_ms,
                "outcome": if c.ok { "ok" } else { "error" },
            });
            events.push((c.at_ms, 1, events.len(), event));
        }
        for f in &self.faults {
            let event = json!({
                "type": "fault",
                "time_ms": f.at_ms,
                "name": f.name,
                "at_unit": f.at_unit,
            });
            events.push((f.at_ms, 1, events.len(), event));
        }
        events.sort_by_key(|(t, rank, seq, _)| (*t, *rank, *seq));
        for (_, _, _, event) in events {
            writeln!(out, "{event}")?;
        }
        for (row, value) in &self.final_values {
            writeln!(
                out,
                "{}",
                json!({ "type": "final", "row": row, "value": value })
            )?;
        }
        out.flush()
    }

    /// [`Report::write_history`] to a new file at `path` (replaced if it exists).
    ///
    /// # Errors
    /// The file could not be created or written.
    pub fn write_history_file(&self, path: &Path) -> std::io::Result<()> {
        let file = std::fs::File::create(path)?;
        self.write_history(std::io::BufWriter::new(file))
    }
}
