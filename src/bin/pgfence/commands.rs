//! The short subcommands: each parses, calls the library, prints.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use pgfence::{AuditFilter, FenceToken, Lease, LeaseState};
use serde_json::json;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::Conn;
use crate::util::{self, cell, fmt_duration, print_table};

pub async fn migrate(conn: &Conn, status_only: bool) -> Result<ExitCode> {
    let pool = conn.pg().await?;
    if !status_only {
        let applied = pgfence::migrate(&pool).await?;
        if applied.is_empty() {
            println!("pgfence schema is up to date");
        }
        for m in &applied {
            println!("applied V{}__{}", m.version, m.name);
        }
    }
    let rows: Vec<Vec<String>> = pgfence::migrate::status(&pool)
        .await?
        .into_iter()
        .map(|m| {
            let when = m
                .applied_on
                .and_then(|t| t.format(&Rfc3339).ok())
                .unwrap_or_else(|| "pending".into());
            vec![format!("V{}", m.version), m.name, when]
        })
        .collect();
    if status_only {
        print_table(&["version", "name", "applied"], &rows);
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn guard(conn: &Conn, table: &str, emit: Option<&Path>) -> Result<ExitCode> {
    let table = util::table(table)?;
    if let Some(dir) = emit {
        let path = emit_migration(dir, &table)?;
        println!("wrote {}", path.display());
        return Ok(ExitCode::SUCCESS);
    }
    let pool = conn.pg().await?;
    if pgfence::guard(&pool, &table).await? {
        println!("guarded {}", cell(&table.quoted()));
    } else {
        println!("{} was already guarded", cell(&table.quoted()));
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes `V{n}__guard_<table>.sql` after the highest version in a refinery folder.
fn emit_migration(dir: &Path, table: &pgfence::TableName) -> Result<std::path::PathBuf> {
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read migrations folder {}", dir.display()))?;
    let mut highest: u64 = 0;
    for entry in entries {
        let name = entry?.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(rest) = name.strip_prefix(['V', 'U', 'v', 'u']) else {
            continue;
        };
        let Some((version, _)) = rest.split_once("__") else {
            continue;
        };
        if let Ok(v) = version.parse::<u64>() {
            highest = highest.max(v);
        }
    }
    let safe: String = format!("{}_{}", table.schema().as_str(), table.name().as_str())
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    let safe = safe.strip_prefix("public_").unwrap_or(&safe).to_owned();
    let path = dir.join(format!("V{}__guard_{safe}.sql", highest + 1));
    let sql = pgfence::guard::guard_migration_sql(table)?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    std::io::Write::write_all(&mut file, sql.as_bytes())?;
    Ok(path)
}

pub async fn unguard(conn: &Conn, table: &str, drop_column: bool) -> Result<ExitCode> {
    let table = util::table(table)?;
    let pool = conn.pg().await?;
    if pgfence::unguard(&pool, &table, drop_column).await? {
        println!("unguarded {}", cell(&table.quoted()));
    } else {
        println!("{} was not guarded", cell(&table.quoted()));
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn tables(conn: &Conn, json: bool) -> Result<ExitCode> {
    let pool = conn.pg().await?;
    let tables = pgfence::guarded_tables(&pool).await?;
    if json {
        let list: Vec<_> = tables
            .iter()
            .map(|t| json!({"schema": t.schema().as_str(), "table": t.name().as_str()}))
            .collect();
        println!("{}", serde_json::Value::Array(list));
    } else {
        for t in tables {
            println!("{}", cell(&t.quoted()));
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn parse_since(s: &str) -> Result<OffsetDateTime> {
    if let Ok(d) = util::parse_duration(s) {
        return Ok(OffsetDateTime::now_utc() - d);
    }
    OffsetDateTime::parse(s, &Rfc3339).with_context(|| {
        format!(
            "--since {:?}: expected a duration (1h, 30m) or an RFC 3339 time",
            cell(s)
        )
    })
}

pub async fn audit(
    conn: &Conn,
    since: Option<&str>,
    resource: Option<String>,
    limit: i64,
    json: bool,
) -> Result<ExitCode> {
    if limit < 1 {
        bail!("--limit must be at least 1");
    }
    let filter = AuditFilter {
        since: since.map(parse_since).transpose()?,
        resource,
        limit,
    };
    let pool = conn.pg().await?;
    let rows = pgfence::audit::list(&pool, &filter).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    if rows.is_empty() {
        println!("no rejected writes");
        return Ok(ExitCode::SUCCESS);
    }
    let opt = |v: &Option<String>| v.as_deref().map(cell).unwrap_or_else(|| "-".into());
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.id.to_string(),
                r.at.format(&Rfc3339).unwrap_or_default(),
                r.operation.clone(),
                opt(&r.resource),
                opt(&r.table),
                opt(&r.key),
                r.presented.to_string(),
                r.current.map_or_else(|| "-".into(), |c| c.to_string()),
                opt(&r.holder),
            ]
        })
        .collect();
    print_table(
        &[
            "id",
            "at",
            "op",
            "resource",
            "table",
            "key",
            "presented",
            "current",
            "holder",
        ],
        &table,
    );
    Ok(ExitCode::SUCCESS)
}

pub async fn audit_prune(conn: &Conn, older_than: Duration) -> Result<ExitCode> {
    let pool = conn.pg().await?;
    let cutoff = OffsetDateTime::now_utc() - older_than;
    let n = pgfence::audit::prune(&pool, cutoff).await?;
    println!(
        "pruned {n} audit row(s) older than {}",
        cutoff.format(&Rfc3339)?
    );
    Ok(ExitCode::SUCCESS)
}

pub async fn lock_acquire(
    conn: &Conn,
    resource: &str,
    ttl: Duration,
    wait: Option<Duration>,
    json: bool,
) -> Result<ExitCode> {
    let resource = util::resource(resource)?;
    pgfence::issuer::check_ttl(ttl)?;
    let lease = util::take_lock(&conn.issuer().await?, &resource, ttl, wait).await?;
    if json {
        println!(
            "{}",
            json!({"resource": resource.as_str(), "token": lease.token().get(), "owner": lease.owner(), "ttl_ms": ttl.as_millis()})
        );
    } else {
        println!(
            "acquired {} token={} owner={} ttl={}",
            resource,
            lease.token(),
            lease.owner(),
            fmt_duration(ttl)
        );
        println!(
            "release: pgfence lock release {} --owner {} --token {}",
            resource,
            lease.owner(),
            lease.token()
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn lock_release(
    conn: &Conn,
    resource: &str,
    owner: &str,
    token: &str,
    json: bool,
) -> Result<ExitCode> {
    let resource = util::resource(resource)?;
    let token: FenceToken = token
        .parse()
        .with_context(|| format!("bad token {:?}", cell(token)))?;
    let issuer = conn.issuer().await?;
    let lease = Lease::resume(resource.clone(), owner, token);
    let state = issuer.release(&lease).await?;
    let word = match state {
        LeaseState::Held => "released",
        LeaseState::Expired => "expired",
        LeaseState::Taken => "taken",
    };
    if json {
        println!("{}", json!({"resource": resource.as_str(), "result": word}));
    } else {
        match state {
            LeaseState::Held => println!("released {resource}"),
            LeaseState::Expired => println!("{resource}: the lock had already expired"),
            LeaseState::Taken => println!("{resource}: another holder has the lock; left it alone"),
        }
    }
    Ok(if state == LeaseState::Held {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    })
}

pub async fn lock_status(conn: &Conn, resource: &str, json: bool) -> Result<ExitCode> {
    let resource = util::resource(resource)?;
    let status = conn.issuer().await?.status(&resource).await?;
    if json {
        println!("{}", serde_json::to_string(&status)?);
    } else if let (Some(owner), Some(token)) = (&status.owner, status.token) {
        println!(
            "{resource}: held by {owner} token={token} expires in {}ms; counter={}",
            status.ttl_ms.unwrap_or(0),
            status.counter
        );
    } else {
        println!("{resource}: free; counter={}", status.counter);
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn reseed(
    conn: &Conn,
    resource: &str,
    floor: Option<i64>,
    json: bool,
) -> Result<ExitCode> {
    let resource = util::resource(resource)?;
    let issuer = conn.issuer().await?;
    let (source, floor) = match floor {
        Some(f) if f < 0 => bail!("--floor must not be negative"),
        Some(f) => ("--floor", f),
        None => (
            "postgres high-water mark",
            pgfence::high_water(&conn.pg().await?, &resource).await?,
        ),
    };
    let before = issuer.status(&resource).await?.counter;
    let after = issuer.raise_floor(&resource, floor).await?;
    if json {
        println!(
            "{}",
            json!({"resource": resource.as_str(), "floor": floor, "before": before, "after": after})
        );
    } else if after > before {
        println!(
            "{resource}: counter raised from {before} to {after} ({source} {floor}); next token {}",
            after + 1
        );
    } else {
        println!("{resource}: counter {before} already at or above {source} {floor}; unchanged");
    }
    Ok(ExitCode::SUCCESS)
}
