//! Shared CLI plumbing: durations, names from the command line, output.

// Printing tables to stdout is part of every command's job.
#![allow(clippy::print_stdout)]

use std::time::Duration;

use anyhow::{Context, Result};

/// Parses `500ms`, `30s`, `5m`, `2h`, `7d` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: expected e.g. 500ms, 30s, 5m, 2h, 7d"))?;
    let ms_per = match unit {
        "ms" => 1,
        "" | "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(format!(
                "invalid duration unit {unit:?} in {s:?}: use ms, s, m, h or d"
            ));
        }
    };
    n.checked_mul(ms_per)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("duration {s:?} is too large"))
}

/// Formats a duration compactly for humans.
pub fn fmt_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 10_000 {
        format!("{ms}ms")
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

/// Hides a password in a URL before printing it.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let creds = &url[scheme + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

/// The error chain on one line, with control characters escaped.
pub fn one_line(e: &anyhow::Error) -> String {
    cell(&format!("{e:#}"))
}

/// A value for a human table: control characters escaped so data cannot forge output.
pub fn cell(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            if c.is_control() {
                c.escape_default().collect::<Vec<_>>()
            } else {
                vec![c]
            }
        })
        .collect()
}

/// At most 60 characters of `s`, for quoting user input back in an error.
pub fn shorten(s: &str) -> String {
    let mut out: String = s.chars().take(60).collect();
    if out.len() < s.len() {
        out.push('…');
    }
    out
}

/// Prints rows as an aligned table.
pub fn print_table(headers: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(headers.iter().map(|h| (*h).to_owned()).collect());
    for row in rows {
        line(row.clone());
    }
}

/// Logs to stderr: WARN and above by default (rejections are WARN), INFO with `--verbose`.
pub fn init_logging(verbose: bool) {
    let level = if verbose {
        tracing::Level::INFO
    } else {
        tracing::Level::WARN
    };
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .with_max_level(level)
        .with_target(true)
        .try_init();
}

/// `name` as a resource, or an error quoting it.
pub fn resource(name: &str) -> Result<pgfence::Resource> {
    pgfence::Resource::new(name)
        .with_context(|| format!("bad resource name {:?}", cell(&shorten(name))))
}

/// `name` (`table` or `schema.table`) as a table name, or an error quoting it.
pub fn table(name: &str) -> Result<pgfence::TableName> {
    pgfence::TableName::parse(name)
        .with_context(|| format!("bad table name {:?}", cell(&shorten(name))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
        for bad in [
            "",
            "s",
            "-1s",
            "1.5s",
            "10 years",
            "99999999999999999999d",
            "1w",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn redacts() {
        assert_eq!(redact("postgres://u:secret@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact("redis://h:6379"), "redis://h:6379");
    }
}
