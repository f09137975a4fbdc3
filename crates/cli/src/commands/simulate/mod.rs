//! `pgfence simulate`: the lock-expiry race, replayed with real servers and real timing.
//!
//! Two workers run the same billing job under the lock: claim the row, write step 1
//! (`processing`), record the charge in the effect ledger, call the payment provider (a fake
//! one on loopback honouring `Idempotency-Key`), write step 2 (`paid`) — several writes under
//! one lease. Worker A writes step 1, records the charge and pauses past the TTL right before
//! its call (a stand-in for a GC pause or VM stall). The lock expires; worker B takes it with a
//! newer token, claims the row, writes step 1, records the charge — the same key — and calls
//! the provider. A wakes, still believing it holds the lock, and makes its call with that key
//! (the provider charges nothing); then its step 2 is rejected by Postgres (A stops), and B's
//! step 2 is applied under the same lease. With `--no-fence` (no fencing, no ledger, no key),
//! A's stale writes silently overwrite B's and the provider charges twice.
//!
//! `--pg-failover` replays the race across a failover of the database itself (a throwaway
//! primary and asynchronous standby): see the `failover` module.

mod events;
mod failover;
mod race;
mod render;
mod servers;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Result, bail};
use pgfence::audit::AuditFilter;

use self::render::{Narrator, Outcome};
use self::servers::Servers;
use crate::cli::{Conn, SimulateArgs, SimulateIssuer};
use crate::util::fmt_duration;

/// Sets up the servers and the demo table, runs the race, prints what happened; succeeds if
/// the outcome is the one the mode predicts.
pub async fn simulate(conn: &Conn, args: &SimulateArgs) -> Result<ExitCode> {
    pgfence::issuer::limits::check_ttl(args.ttl)?;
    if args.pg_failover {
        return failover::simulate_failover(conn, args).await;
    }
    if args.pause <= args.ttl {
        bail!(
            "--pause ({}) must be longer than --ttl ({}) for the lease to expire",
            fmt_duration(args.pause),
            fmt_duration(args.ttl)
        );
    }
    if args.pause > Duration::from_secs(60) {
        bail!("--pause is capped at 60s");
    }
    let postgres = args.issuer == SimulateIssuer::Postgres;
    if postgres && conn.issuer_url.as_deref().is_some_and(|u| !u.is_empty()) {
        bail!(
            "--issuer postgres runs the PostgreSQL issuer on the demo's database; drop --issuer-url / PGFENCE_ISSUER_URL, or pass the database there instead"
        );
    }
    let etcd = conn.issuer_url.as_deref().is_some_and(|u| {
        u.get(..7)
            .is_some_and(|s| s.eq_ignore_ascii_case("etcd://"))
    });
    if etcd && args.ttl < Duration::from_secs(2) {
        bail!(
            "etcd leases count whole seconds, at least 2 s on a default etcd: use e.g. --ttl 2s --pause 4s"
        );
    }
    let say = Narrator {
        mermaid: args.mermaid,
    };
    say.line(format!(
        "pgfence simulate: the lock-expiry race ({}), lock TTL {}, worker A pauses {}",
        if args.no_fence {
            "UNFENCED writes"
        } else {
            "fenced writes"
        },
        fmt_duration(args.ttl),
        fmt_duration(args.pause)
    ));

    // Servers: the given URLs, or throwaway ones that live as long as `servers`.
    let servers = Servers::start(conn, postgres, &say).await?;
    let fenced = !args.no_fence;
    let stage = servers::setup(&servers, fenced, &say).await?;

    let tokens = race::race(stage.clone(), args.ttl, args.pause).await;
    let final_row = race::final_row(&stage).await;
    let audit = pgfence::audit::list(
        &stage.pool,
        &AuditFilter {
            resource: Some(stage.resource.to_string()),
            ..Default::default()
        },
    )
    .await;

    // Leave nothing behind on the user's servers; throwaway ones simply go away.
    if servers.has_users_server() {
        servers::cleanup(&stage).await;
    }
    let (a_token, b_token) = tokens?;
    let outcome = Outcome {
        a_token,
        b_token,
        row: final_row?,
        audit: audit?,
        events: stage.rec.sorted(),
        charges: stage.provider.charges("batch-42"),
    };

    let printed = render::print_events(&outcome.events, fenced, args.mermaid);
    let ok = render::verdict(&say, &outcome, fenced);

    servers.stop(&say);
    printed?;
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
