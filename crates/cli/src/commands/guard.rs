//! `pgfence guard`, `unguard` and `tables`: the guard trigger on user tables.

// Printing the result is the command's job.
#![allow(clippy::print_stdout)]

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use pgfence::TableName;
use serde_json::json;

use crate::cli::Conn;
use crate::util::{self, cell};

/// Guards `table`, or with `emit` writes the guarding migration into that folder instead.
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
fn emit_migration(dir: &Path, table: &TableName) -> Result<PathBuf> {
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
    let sql = pgfence::guard_migration_sql(table)?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    std::io::Write::write_all(&mut file, sql.as_bytes())?;
    Ok(path)
}

/// Removes the guard trigger from `table` (and its `fence` column with `drop_column`).
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

/// Lists the guarded tables, one per line or as a JSON array.
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
