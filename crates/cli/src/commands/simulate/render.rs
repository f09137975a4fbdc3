//! Telling the story: narration, the timeline or Mermaid diagram, and the verdict.

// Printing the run is the command's job.
#![allow(clippy::print_stdout)]

use std::fmt::Write as _;

use pgfence::audit::AuditEntry;

use super::events::{Event, What};
use super::race::FinalRow;
use crate::util::{fmt_duration, out, outln};

/// Prints narration: to stdout, except in `--mermaid` mode where stdout is the diagram.
pub struct Narrator {
    /// Whether stdout is reserved for the diagram.
    pub mermaid: bool,
}

impl Narrator {
    /// Prints one line of narration. On a closed stdout the run goes on (and cleans up)
    /// without it: pgfence then exits quietly ([`crate::util::stdout_closed`]).
    pub fn line(&self, line: String) {
        if self.mermaid {
            eprintln!("{line}");
        } else if !crate::util::stdout_closed() {
            let _ = outln!("{line}");
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
    /// Charges the payment provider made for the batch.
    pub charges: u64,
}

/// Prints the events on stdout: a Mermaid diagram, or a timeline and a blank line.
pub fn print_events(events: &[Event], fenced: bool, mermaid: bool) -> anyhow::Result<()> {
    if mermaid {
        out!("{}", self::mermaid(events, fenced))?;
    } else {
        for line in timeline(events) {
            outln!("{line}")?;
        }
        outln!()?;
    }
    Ok(())
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
        charges,
    } = outcome;
    let a_answer = events.iter().find_map(|e| match &e.what {
        What::Answer {
            status, replayed, ..
        } if e.actor == 'A' => Some((*status, *replayed)),
        _ => None,
    });
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
        say.line(format!(
            "provider: {charges} charge(s) for batch-42{}",
            match a_answer {
                Some((409, _)) => "; A's late call carried B's idempotency key and was refused as a concurrent duplicate (409)",
                Some((_, true)) => "; A's late call carried B's idempotency key and got B's charge replayed",
                _ => "",
            }
        ));
        let ok = writes('A', false) == 1
            && writes('A', true) == 1
            && writes('B', true) == 2
            && *charges == 1
            && a_answer.is_some_and(|(status, replayed)| status == 409 || replayed)
            && row.paid_by == "B"
            && row.status == "paid"
            && row.token == *b_token
            && audit.len() == 1;
        if ok {
            say.line(format!(
                "A's stale write (token {a_token}) was REJECTED because B's token {b_token} had already claimed the row; \
                 B's second write under the same lease was applied after it; the provider charged once: fencing works."
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
        say.line(format!("provider: {charges} charge(s) for batch-42"));
        let damaged = row.paid_by == "A" && writes('A', true) == 2 && *charges == 2;
        if damaged {
            say.line(format!(
                "DAMAGE: A's stale writes (token {a_token}, unfenced) overwrote B's newer writes (token {b_token}): \
                 B's final paid_by = B is gone. Both workers believed they held the lock, and both paid batch-42: \
                 the provider charged {charges} times. Run without --no-fence to see fencing stop it."
            ));
        } else {
            say.line("the race did not reproduce this time (try a longer --pause)".into());
        }
        damaged
    }
}

/// The first characters of an idempotency key.
fn short_key(key: &str) -> String {
    key.chars().take(8).collect::<String>() + "…"
}

/// A provider's answer in words.
fn answer_words(status: u16, charge: Option<&str>, replayed: bool) -> String {
    match (status, charge) {
        (200, Some(c)) if replayed => {
            format!("provider answers 200: charge {c} replayed for the same key, nothing charged")
        }
        (200, Some(c)) => format!("provider answers 200: charged, {c}"),
        (409, _) => {
            "provider answers 409 Conflict: the same key is in flight, nothing charged".to_owned()
        }
        (s, _) => format!("provider answers {s}"),
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
        What::Effect { key, holders } => format!(
            "records the charge in the effect ledger: idempotency key {}{}",
            short_key(key),
            if *holders == 1 {
                " (new)"
            } else {
                " (the same: recorded by an earlier lease, no outcome yet)"
            }
        ),
        What::Call { key, took } => format!(
            "calls the payment provider {} ({})",
            match key {
                Some(k) => format!("with Idempotency-Key {}", short_key(k)),
                None => "without an idempotency key".to_owned(),
            },
            fmt_duration(*took)
        ),
        What::Answer {
            status,
            charge,
            replayed,
        } => answer_words(*status, charge.as_deref(), *replayed),
        What::Outcome(charge) => {
            format!("records the outcome in the effect ledger: charged, {charge}")
        }
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
    out.push_str("    participant A as Worker A\n    participant R as Lock service\n    participant P as Postgres\n    participant V as Payment provider\n    participant B as Worker B\n");
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
            What::Effect { key, .. } => format!(
                "    {who}->>P: +{at}ms record charge in effect ledger\n    P-->>{who}: key {}\n",
                short_key(key)
            ),
            What::Call { key, .. } => format!(
                "    {who}->>V: +{at}ms POST /charges {}\n",
                key.as_deref()
                    .map(|k| format!("Idempotency-Key {}", short_key(k)))
                    .unwrap_or_else(|| "no key".into())
            ),
            What::Answer {
                status,
                charge,
                replayed,
            } => format!(
                "    V-->>{who}: +{at}ms {}\n",
                answer_words(*status, charge.as_deref(), *replayed)
            ),
            What::Outcome(charge) => {
                format!("    {who}->>P: +{at}ms record outcome {charge} in effect ledger\n")
            }
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
            "fenced: A's stale write rejected, B's second write applied, one charge"
        } else {
            "unfenced: A's stale writes overwrote B's, two charges"
        }
    );
    out
}
