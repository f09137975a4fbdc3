//! Telling the story: narration, the timeline or Mermaid diagram, and the verdict.

// Printing the run is the command's job.
#![allow(clippy::print_stdout)]

use std::fmt::Write as _;

use pgfence::AuditEntry;

use super::events::{Event, What};
use crate::util::fmt_duration;

/// Prints narration: to stdout, except in `--mermaid` mode where stdout is the diagram.
pub struct Narrator {
    /// Whether stdout is reserved for the diagram.
    pub mermaid: bool,
}

impl Narrator {
    /// Prints one line of narration.
    pub fn line(&self, line: String) {
        if self.mermaid {
            eprintln!("{line}")
        } else {
            println!("{line}")
        }
    }
}

/// How the race ended.
pub struct Outcome {
    /// A's fence token.
    pub a_token: i64,
    /// B's fence token.
    pub b_token: i64,
    /// Who the row says paid in the end.
    pub paid_by: String,
    /// The token the row's fence was written with in the end (0 when unfenced).
    pub fence: i64,
    /// The demo resource's audit rows.
    pub audit: Vec<AuditEntry>,
    /// Everything that happened, in time order.
    pub events: Vec<Event>,
}

/// Prints the events on stdout: a Mermaid diagram, or a timeline and a blank line.
pub fn print_events(events: &[Event], fenced: bool, mermaid: bool) {
    if mermaid {
        print!("{}", self::mermaid(events, fenced));
    } else {
        for line in timeline(events) {
            println!("{line}");
        }
        println!();
    }
}

/// Says what the race did to the row; true if it went as the mode predicts (fenced: A
/// rejected and audited; unfenced: A's stale write won).
pub fn verdict(say: &Narrator, outcome: &Outcome, fenced: bool) -> bool {
    let Outcome {
        a_token,
        b_token,
        paid_by,
        fence,
        audit,
        events,
    } = outcome;
    let a_rejected = events
        .iter()
        .any(|e| e.actor == 'A' && matches!(e.what, What::Write { applied: false, .. }));
    if fenced {
        say.line(format!(
            "result: the row holds B's write (paid_by = {paid_by}, fence = {fence})"
        ));
        say.line(format!(
            "audit:  {} rejected write(s) recorded in pgfence.audit{}",
            audit.len(),
            audit
                .first()
                .map(|a| format!(
                    ": {} by {} with token {} (row fence {})",
                    a.operation,
                    short(a.holder.as_deref()),
                    a.presented,
                    a.current.unwrap_or(0)
                ))
                .unwrap_or_default()
        ));
        let ok = a_rejected && paid_by == "B" && audit.len() == 1;
        if ok {
            say.line(format!(
                "A's stale write (token {a_token}) was REJECTED because B's token {b_token} had already written: fencing works."
            ));
        } else {
            say.line("unexpected outcome: A's stale write was not rejected as expected".into());
        }
        ok
    } else {
        say.line(format!("result: the row says paid_by = {paid_by}"));
        let damaged = paid_by == "A";
        if damaged {
            say.line(format!(
                "DAMAGE: A's stale write (token {a_token}, unfenced) overwrote B's newer write (token {b_token}). \
                 Both workers believed they held the lock. Run without --no-fence to see fencing stop it."
            ));
        } else {
            say.line("the race did not reproduce this time (try a longer --pause)".into());
        }
        damaged
    }
}

/// The first characters of a holder id, or `-`.
fn short(holder: Option<&str>) -> String {
    holder
        .map(|h| h.chars().take(8).collect::<String>() + "…")
        .unwrap_or_else(|| "-".into())
}

/// One event in words.
fn describe(e: &Event) -> String {
    match &e.what {
        What::Acquired { token, ttl } => format!(
            "acquires the lock (TTL {}) -> fence token {token}",
            fmt_duration(*ttl)
        ),
        What::Read { paid_by } => format!("reads batch-42: paid_by = {paid_by}"),
        What::Pause(d) => format!(
            "pauses for {} (GC pause, VM stall, swap...)",
            fmt_duration(*d)
        ),
        What::Expired => {
            "lock expires: A's lease has run out, but A is still paused and does not know".into()
        }
        What::Wake => "wakes up, still believing it holds the lock".into(),
        What::Write {
            token: Some(t),
            detail,
            ..
        } => format!("writes paid_by = {} with token {t}: {detail}", e.actor),
        What::Write {
            token: None,
            detail,
            ..
        } => format!("writes paid_by = {}: {detail}", e.actor),
        What::Released(word) => (*word).to_owned(),
    }
}

/// One line per event: time since start, who, what.
fn timeline(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            let who = match e.actor {
                '-' => "redis".to_owned(),
                a => format!("{a}    "),
            };
            format!(
                "{:>8}  {who}  {}",
                format!("+{}ms", e.at.as_millis()),
                describe(e)
            )
        })
        .collect()
}

/// The events as a Mermaid sequence diagram.
fn mermaid(events: &[Event], fenced: bool) -> String {
    let mut out = String::from("sequenceDiagram\n");
    out.push_str("    participant A as Worker A\n    participant R as Redis\n    participant P as Postgres\n    participant B as Worker B\n");
    for e in events {
        let who = e.actor;
        let at = e.at.as_millis();
        let line = match &e.what {
            What::Acquired { token, ttl } => format!(
                "    {who}->>R: +{at}ms acquire lock (TTL {})\n    R-->>{who}: token {token}\n",
                fmt_duration(*ttl)
            ),
            What::Read { paid_by } => format!(
                "    {who}->>P: +{at}ms read batch-42\n    P-->>{who}: paid_by = {paid_by}\n"
            ),
            What::Pause(d) => format!(
                "    Note over A: +{at}ms paused {} (GC)\n",
                fmt_duration(*d)
            ),
            What::Expired => format!("    Note over R: +{at}ms lock expires\n"),
            What::Wake => {
                format!("    Note over A: +{at}ms wakes, still believes it holds the lock\n")
            }
            What::Write {
                token,
                applied,
                detail,
            } => {
                let with = token.map(|t| format!(" fence={t}")).unwrap_or_default();
                let reply = if *applied {
                    format!("P-->>{who}: {detail}")
                } else {
                    format!("P--x{who}: {detail}")
                };
                format!("    {who}->>P: +{at}ms UPDATE paid_by={who}{with}\n    {reply}\n")
            }
            What::Released(word) => {
                format!("    {who}->>R: +{at}ms release\n    R-->>{who}: {word}\n")
            }
        };
        out.push_str(&line.replace(['(', ')'], ""));
    }
    let _ = writeln!(
        out,
        "    Note over P: {}",
        if fenced {
            "fenced: stale write rejected"
        } else {
            "unfenced: stale write overwrote B"
        }
    );
    out
}
