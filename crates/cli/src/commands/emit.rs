//! `guard --emit-migration DIR`: the guarding migration as a file of the folder's migration
//! tool, sqlx-cli or refinery, told from the files already there or chosen with
//! `--migration-format`.
//!
//! The two tools do not share a folder: sqlx's migrator refuses any `*_*.sql` file without an
//! integer version before its first `_` (a refinery `V1__x.sql`: "expected integer version
//! prefix"), and refinery skips sqlx's files. So a folder holding both is refused, and so is
//! a format that is not the folder's tool.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use pgfence::guard::GuardMode;
use pgfence::table::TableName;

use crate::cli::MigrationFormat;
use crate::util::cell;

/// How deep refinery's subfolders are searched for versions (refinery walks them all).
const MAX_DEPTH: usize = 16;
/// The longest name part (after the version) of a file this writes.
const MAX_NAME: usize = 80;

/// A migration already in the folder.
#[derive(Debug)]
struct Existing {
    /// The file's path, relative to the folder.
    file: String,
    version: i64,
    /// How many characters the version was written with (`0003`: 4).
    digits: usize,
    /// sqlx: an `.up.sql` or `.down.sql` file.
    reversible: bool,
}

/// The migrations of each tool in a folder.
#[derive(Debug, Default)]
struct Folder {
    sqlx: Vec<Existing>,
    refinery: Vec<Existing>,
}

/// The file layout to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tool {
    Sqlx { reversible: bool },
    Refinery,
}

/// Writes the migration that guards `tables` (one migration for all of them: one transaction
/// under either tool) into `dir`, named for the folder's tool, and returns the files written
/// (two for a reversible sqlx migration). Nothing is written when anything is wrong.
pub fn write_guard_migration(
    dir: &Path,
    tables: &[TableName],
    mode: GuardMode,
    format: Option<MigrationFormat>,
) -> Result<Vec<PathBuf>> {
    let folder = Folder::read(dir)?;
    let tool = folder.tool(dir, format)?;
    let name = migration_name(tables);
    let up = pgfence::guard::guard_migration_sql_for(tables, mode)?;
    let files: Vec<(PathBuf, String)> = match tool {
        Tool::Refinery => {
            let version = folder.next_refinery_version()?;
            vec![(dir.join(format!("V{version}__{name}.sql")), up)]
        }
        Tool::Sqlx { reversible: false } => {
            let version = folder.next_sqlx_version()?;
            vec![(dir.join(format!("{version}_{name}.sql")), up)]
        }
        Tool::Sqlx { reversible: true } => {
            let version = folder.next_sqlx_version()?;
            let down = pgfence::guard::unguard_migration_sql(tables)?;
            vec![
                (dir.join(format!("{version}_{name}.up.sql")), up),
                (dir.join(format!("{version}_{name}.down.sql")), down),
            ]
        }
    };
    let mut written = Vec::with_capacity(files.len());
    for (path, sql) in files {
        if let Err(e) = create(&path, &sql) {
            // All the files or none: a reversible migration without its down file is not one.
            for done in &written {
                let _ = std::fs::remove_file(done);
            }
            return Err(e);
        }
        written.push(path);
    }
    Ok(written)
}

/// Creates `path` (which must not exist) holding `sql`; removes it again when the write fails.
fn create(path: &Path, sql: &str) -> Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    if let Err(e) = std::io::Write::write_all(&mut file, sql.as_bytes()) {
        drop(file);
        let _ = std::fs::remove_file(path);
        return Err(e).with_context(|| format!("cannot write {}", path.display()));
    }
    Ok(())
}

impl Folder {
    /// Reads the migrations in `dir`: sqlx's at its top level (sqlx reads no subfolder),
    /// refinery's anywhere below it (refinery reads them all).
    fn read(dir: &Path) -> Result<Self> {
        let meta = std::fs::metadata(dir)
            .with_context(|| format!("cannot read migrations folder {}", dir.display()))?;
        if !meta.is_dir() {
            bail!(
                "cannot read migrations folder {}: not a folder",
                dir.display()
            );
        }
        let mut folder = Self::default();
        folder.scan(dir, "", 0)?;
        folder.sqlx.sort_by_key(|m| (m.version, m.file.clone()));
        folder.refinery.sort_by_key(|m| (m.version, m.file.clone()));
        Ok(folder)
    }

    fn scan(&mut self, dir: &Path, under: &str, depth: usize) -> Result<()> {
        let entries = std::fs::read_dir(dir)
            .with_context(|| format!("cannot read migrations folder {}", dir.display()))?;
        for entry in entries {
            let entry = entry
                .with_context(|| format!("cannot read migrations folder {}", dir.display()))?;
            // A name that is not UTF-8 is no migration of either tool's that this can number.
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            let path = entry.path();
            let relative = format!("{under}{name}");
            // Real subfolders only (a symbolic link to a folder could loop).
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                if depth < MAX_DEPTH {
                    self.scan(&path, &format!("{relative}/"), depth + 1)?;
                }
                continue;
            }
            // Like both tools: a link to a file is that file.
            if !std::fs::metadata(&path).is_ok_and(|m| m.is_file()) {
                continue;
            }
            if let Some((version, digits)) = refinery_version(&name) {
                self.refinery.push(Existing {
                    file: relative,
                    version,
                    digits,
                    reversible: false,
                });
            } else if depth == 0
                && let Some((version, digits)) = sqlx_version(&name)
            {
                self.sqlx.push(Existing {
                    file: relative,
                    version,
                    digits,
                    reversible: name.ends_with(".up.sql") || name.ends_with(".down.sql"),
                });
            }
        }
        Ok(())
    }

    /// The tool to write for: the folder's, or `format` when it agrees with the folder.
    fn tool(&self, dir: &Path, format: Option<MigrationFormat>) -> Result<Tool> {
        let wanted = format.map(|f| match f {
            MigrationFormat::Sqlx => Tool::Sqlx { reversible: false },
            MigrationFormat::SqlxReversible => Tool::Sqlx { reversible: true },
            MigrationFormat::Refinery => Tool::Refinery,
        });
        let dir = dir.display();
        match (self.sqlx.first(), self.refinery.first(), wanted) {
            (Some(s), Some(r), _) => bail!(
                "migrations folder {dir} holds files of two tools, sqlx-cli's ({}) and refinery's ({}), and neither tool accepts the other's: move one set to its own folder, then emit into the one the guard migration belongs to",
                cell(&s.file),
                cell(&r.file)
            ),
            (Some(s), None, Some(Tool::Refinery)) => bail!(
                "migrations folder {dir} holds sqlx-cli migrations ({}): a refinery file there would stop sqlx from reading the folder; use --migration-format sqlx or sqlx-reversible, or another folder",
                cell(&s.file)
            ),
            (None, Some(r), Some(Tool::Sqlx { .. })) => bail!(
                "migrations folder {dir} holds refinery migrations ({}): sqlx-cli would refuse that file; use --migration-format refinery, or another folder",
                cell(&r.file)
            ),
            (_, _, Some(tool)) => Ok(tool),
            // sqlx-cli's own rule for `migrate add`: reversible when the latest one is.
            (Some(_), None, None) => Ok(Tool::Sqlx {
                reversible: self.sqlx.last().is_some_and(|m| m.reversible),
            }),
            (None, Some(_), None) => Ok(Tool::Refinery),
            // An empty folder: sqlx-cli's default (pgfence runs on sqlx).
            (None, None, None) => Ok(Tool::Sqlx { reversible: false }),
        }
    }

    /// One above the highest refinery version (1 in an empty folder).
    fn next_refinery_version(&self) -> Result<i64> {
        let highest = self.refinery.last().map_or(0, |m| m.version);
        highest
            .checked_add(1)
            .context("the folder's highest migration version is the largest there is")
    }

    /// The next sqlx version, written as sqlx-cli's `migrate add` would: sequential (the
    /// latest plus one, as many digits as the latest) when the folder's two latest versions
    /// are consecutive or its one migration is version 0 or 1; else a UTC timestamp
    /// (`YYYYMMDDHHMMSS`, sqlx-cli's default), kept above the highest version there.
    fn next_sqlx_version(&self) -> Result<String> {
        let mut versions: Vec<&Existing> = Vec::new();
        for m in &self.sqlx {
            // An `.up.sql` and its `.down.sql` are one migration.
            if versions.last().is_none_or(|last| last.version != m.version) {
                versions.push(m);
            }
        }
        let overflow =
            || anyhow::anyhow!("the folder's highest migration version is the largest there is");
        let sequential = match versions.as_slice() {
            [.., previous, latest] => latest.version.checked_sub(previous.version) == Some(1),
            [only] => matches!(only.version, 0 | 1),
            [] => false,
        };
        let highest = versions.last().map(|m| (m.version, m.digits));
        if sequential && let Some((version, digits)) = highest {
            let next = version.checked_add(1).ok_or_else(overflow)?;
            return Ok(format!("{next:0digits$}"));
        }
        let now = timestamp_now();
        match highest {
            Some((version, _)) if version >= now => {
                Ok(version.checked_add(1).ok_or_else(overflow)?.to_string())
            }
            _ => Ok(now.to_string()),
        }
    }
}

/// `V12__name.sql` / `U3__name.rs` (refinery's `^[U|V](\d+(\.\d+)?)__(\w+)\.(sql|rs)$`): the
/// version, and its number of digits.
fn refinery_version(file: &str) -> Option<(i64, usize)> {
    let stem = file
        .strip_suffix(".sql")
        .or_else(|| file.strip_suffix(".rs"))?;
    let rest = stem.strip_prefix(['U', 'V'])?;
    let (version, name) = rest.split_once("__")?;
    let whole = version.split_once('.').map_or(version, |(whole, _)| whole);
    let is_version = !whole.is_empty()
        && version
            .split('.')
            .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()))
        && version.matches('.').count() <= 1;
    let is_name = !name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || c == '_');
    if !(is_version && is_name) {
        return None;
    }
    Some((whole.parse().ok()?, whole.len()))
}

/// `20240101120000_name.sql`, `0003_name.up.sql` (sqlx's rule: an `.sql` file whose name up to
/// its first `_` is an integer): the version, and its number of characters.
fn sqlx_version(file: &str) -> Option<(i64, usize)> {
    let (version, rest) = file.split_once('_')?;
    if !rest.ends_with(".sql") {
        return None;
    }
    Some((version.parse().ok()?, version.len()))
}

/// The current UTC time as sqlx-cli writes a version: `YYYYMMDDHHMMSS`.
fn timestamp_now() -> i64 {
    let now = time::OffsetDateTime::now_utc();
    let date = i64::from(now.year()) * 10_000
        + i64::from(u8::from(now.month())) * 100
        + i64::from(now.day());
    let clock =
        i64::from(now.hour()) * 10_000 + i64::from(now.minute()) * 100 + i64::from(now.second());
    date * 1_000_000 + clock
}

/// `guard_<table>` (schema `public` left out, other schemas as `<schema>_<table>`), ASCII
/// letters and digits with `_` for anything else; several tables joined with `_`, or
/// `guard_<first>_and_<n>_more` when that would be long.
fn migration_name(tables: &[TableName]) -> String {
    let part = |t: &TableName| -> String {
        let safe: String = format!("{}_{}", t.schema().as_str(), t.name().as_str())
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '_'
                }
            })
            .collect();
        safe.strip_prefix("public_").unwrap_or(&safe).to_owned()
    };
    let parts: Vec<String> = tables.iter().map(part).collect();
    let joined = parts.join("_");
    let prefix = "guard_";
    let (mut body, suffix) = if parts.len() > 1 && prefix.len() + joined.len() > MAX_NAME {
        (parts[0].clone(), format!("_and_{}_more", parts.len() - 1))
    } else {
        (joined, String::new())
    };
    body.truncate(MAX_NAME.saturating_sub(prefix.len() + suffix.len()));
    format!("{prefix}{body}{suffix}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refinery_names() {
        assert_eq!(refinery_version("V1__users.sql"), Some((1, 1)));
        assert_eq!(refinery_version("U0007__orders.rs"), Some((7, 4)));
        assert_eq!(refinery_version("V2.1__x.sql"), Some((2, 1)));
        for not in [
            "V1_users.sql",
            "v1__users.sql",
            "V__users.sql",
            "V1__.sql",
            "V1__a-b.sql",
            "V1__users.txt",
            "1_users.sql",
            "README",
        ] {
            assert_eq!(refinery_version(not), None, "{not}");
        }
    }

    #[test]
    fn sqlx_names() {
        assert_eq!(sqlx_version("0003_users.sql"), Some((3, 4)));
        assert_eq!(
            sqlx_version("20240101120000_a b.up.sql"),
            Some((20_240_101_120_000, 14))
        );
        for not in ["V1__users.sql", "3users.sql", "3_users.rs", "x_users.sql"] {
            assert_eq!(sqlx_version(not), None, "{not}");
        }
    }

    #[test]
    fn names_stay_short() {
        let t = |s: &str| TableName::parse(s).unwrap();
        assert_eq!(migration_name(&[t("orders")]), "guard_orders");
        assert_eq!(
            migration_name(&[t("orders"), t("billing.\"Invoices\"")]),
            "guard_orders_billing_invoices"
        );
        let many: Vec<TableName> = (0..20).map(|i| t(&format!("table_number_{i}"))).collect();
        let name = migration_name(&many);
        assert_eq!(name, "guard_table_number_0_and_19_more");
        let long = t(&"x".repeat(63));
        assert!(migration_name(&[long]).len() <= MAX_NAME);
    }

    #[test]
    fn timestamps_read_as_sqlx_cli_writes_them() {
        let now = timestamp_now();
        assert_eq!(now.to_string().len(), 14, "{now}");
        assert!(now > 20_260_000_000_000, "{now}");
    }
}
