//! Telling the story: narration, the timeline or Mermaid diagram, and the verdict.

// Printing the run is the command's job.
#![allow(clippy::print_stdout)]

use std::fmt::Write as _;

use pgfence::AuditEntry;

use super::events::{Event, What};
use super::race::FinalRow;
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
    /// The demo row in the end.
    pub row: FinalRow,
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
/// rejected and audited, both of B's writes applied; unfenced: A's stale writes won).
pub fn verdict(say: &Narrator, outcome: &Outcome, fenced: bool) -> bool {
    let Outcome {
        a_token,
        b_token,
        row,
        audit,
        events,
    } = outcome;
    let writes = |actor: char, applied: bool| {
        events
            .iter()
            .filter(|e| {
                e.actor == actor && matches!(e.what, What::Write { applied: a, .. } if a == applied)
            })
            .count()
    };
    if fenced {
        say.line(format!(
            "result: the row holds B's final write (status = {}, paid_by = {}, fence = {})",
            row.status, row.paid_by, row.token
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
        let ok = writes('A', false) == 1
            && writes('A', true) == 0
            && writes('B', true) == 2
            && row.paid_by == "B"
            && row.status == "paid"
            && row.token == *b_token
            && audit.len() == 1;
        if ok {
            say.line(format!(
                "A's stale write (token {a_token}) was REJECTED because B's token {b_token} had already claimed the row; \
                 B's second write under the same lease was applied after it: fencing works."
            ));
        } else {
            say.line("unexpected outcome: A's stale write was not rejected as expected".into());
        }
        ok
    } else {
        say.line(format!(
            "result: the row says status = {}, paid_by = {}",
            row.status, row.paid_by
        ));
        let damaged = row.paid_by == "A" && writes('A', true) == 2;
        if damaged {
            say.line(format!(
                "DAMAGE: A's stale writes (token {a_token}, unfenced) overwrote both of B's newer writes (token {b_token}): \
                 B's step 1, then B's final paid_by = B. Both workers believed they held the lock, and both paid batch-42. \
                 Run without --no-fence to see fencing stop it."
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
        What::Read {
            claimed_with,
            status,
            paid_by,
        } => format!(
            "{}: status = {status}, paid_by = {paid_by}",
            match claimed_with {
                Some(t) => format!("claims batch-42 with token {t}"),
                None => "reads batch-42".into(),
            }
        ),
        What::Pause(d) => format!(
            "pauses for {} (GC pause, VM stall, swap...)",
            fmt_duration(*d)
        ),
        What::Expired => {
            "lock expires: A's lease has run out, but A is still paused and does not know".into()
        }
        What::Wake => "wakes up, still believing it holds the lock".into(),
        What::Write {
            step,
            set,
            token,
            detail,
            ..
        } => format!(
            "step {step}: writes {set}{}: {detail}",
            token
                .map(|t| format!(" with token {t}"))
                .unwrap_or_default()
        ),
        What::Provider(d) => format!("calls the payment provider ({})", fmt_duration(*d)),
        What::FencedOut => "stops: a newer lease owns batch-42, so its job is over".into(),
        What::Released(word) => (*word).to_owned(),
    }
}

/// One line per event: time since start, who, what.
fn timeline(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            let who = match e.actor {
                '-' => "lock ".to_owned(),
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
    out.push_str("    participant A as Worker A\n    participant R as Lock service\n    participant P as Postgres\n    participant B as Worker B\n");
    for e in events {
        let who = e.actor;
        let at = e.at.as_millis();
        let line = match &e.what {
            What::Acquired { token, ttl } => format!(
                "    {who}->>R: +{at}ms acquire lock (TTL {})\n    R-->>{who}: token {token}\n",
                fmt_duration(*ttl)
            ),
            What::Read {
                claimed_with,
                status,
                paid_by,
            } => format!(
                "    {who}->>P: +{at}ms {}\n    P-->>{who}: status = {status}, paid_by = {paid_by}\n",
                match claimed_with {
                    Some(t) => format!("claim batch-42 fence={t}"),
                    None => "read batch-42".into(),
                }
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
                step,
                set,
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
                format!("    {who}->>P: +{at}ms step {step} UPDATE {set}{with}\n    {reply}\n")
            }
            What::Provider(d) => format!(
                "    Note over {who}: +{at}ms calls the payment provider {}\n",
                fmt_duration(*d)
            ),
            What::FencedOut => {
                format!("    Note over {who}: +{at}ms stops, a newer lease owns the row\n")
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
            "fenced: A's stale write rejected, B's second write applied"
        } else {
            "unfenced: A's stale writes overwrote both of B's"
        }
    );
    out
}
