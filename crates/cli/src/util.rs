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
    let n: u64 = digits.parse().map_err(|_| {
        if digits.is_empty() {
            format!("invalid duration {s:?}: expected e.g. 500ms, 30s, 5m, 2h, 7d")
        } else {
            format!("duration {s:?} is too large")
        }
    })?;
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

/// Parses a lease TTL: a duration ([`parse_duration`]) within the library's bounds, so every
/// bad TTL gets the same one-line usage error.
pub fn parse_ttl(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    pgfence::issuer::limits::check_ttl(d).map_err(|_| {
        format!(
            "a lease TTL must be between {} and {}h",
            fmt_duration(pgfence::issuer::limits::MIN_TTL),
            pgfence::issuer::limits::MAX_TTL.as_secs() / 3600
        )
    })
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

/// Warnings held back until the command's outcome is known ([`warn_later`]).
static WARNINGS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Holds a warning back until the command succeeds ([`flush_warnings`] prints it then) or
/// fails (its error line carries it, [`take_warnings`]): an error is one line on stderr, never
/// preceded by a warning.
pub fn warn_later(message: String) {
    let mut warnings = WARNINGS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !warnings.contains(&message) {
        warnings.push(message);
    }
}

/// The held-back warnings, removed.
pub fn take_warnings() -> Vec<String> {
    std::mem::take(
        &mut *WARNINGS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    )
}

/// Prints the held-back warnings, one line each: once the command can no longer fail (or,
/// for a long-running one, once it is under way).
pub fn flush_warnings() {
    for w in take_warnings() {
        eprintln!("pgfence: warning: {}", cell(&scrub(&w)));
    }
}

/// Secrets from the configured URLs (passwords, token-like query values), hidden wherever
/// they appear in output, even outside a URL.
static SECRETS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// Remembers the secrets in `urls`, so that [`scrub`] hides them in any text (errors, logs).
pub fn register_secrets<'a>(urls: impl IntoIterator<Item = &'a str>) {
    let mut all: Vec<String> = urls.into_iter().flat_map(secrets_of).collect();
    // Longest first, so a secret containing another is replaced whole.
    all.sort_by_key(|s| std::cmp::Reverse(s.len()));
    all.dedup();
    let _ = SECRETS.set(all);
}

/// True for query parameter names that carry credentials: `password`, `sslpassword`,
/// `token`, `secret`, `key`, `auth`, ... (matched case-insensitively, percent-decoded).
fn sensitive_param(name: &str) -> bool {
    let name = percent_decode(name).to_ascii_lowercase();
    [
        "pass",
        "pwd",
        "secret",
        "token",
        "key",
        "auth",
        "credential",
        "signature",
    ]
    .iter()
    .any(|w| name.contains(w))
}

/// `%XX` escapes decoded (lossily); anything malformed is kept as written.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| char::from(b).to_digit(16);
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Where a URL's parts are: `(after "://", end of userinfo '@')`, byte offsets into `url`.
fn userinfo_at(url: &str) -> Option<(usize, usize)> {
    let start = url.find("://")? + 3;
    let rest = &url[start..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    // An '@' in the authority ends the userinfo. Without one, a password holding a raw '/',
    // '?' or '#' may still be there: take the last '@' anywhere (hiding too much is fine).
    let at = rest[..authority_end]
        .rfind('@')
        .or_else(|| rest.rfind('@'))?;
    Some((start, start + at))
}

/// The secrets in `url`: its userinfo password and its token-like query values (each as
/// written and percent-decoded).
fn secrets_of(url: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut query_from = 0;
    if let Some((start, at)) = userinfo_at(url) {
        if let Some((_, pw)) = url[start..at].split_once(':') {
            out.push(pw.to_owned());
        }
        query_from = at;
    }
    if let Some(q) = url[query_from..].find('?') {
        let query = &url[query_from + q + 1..];
        let query = query.split('#').next().unwrap_or(query);
        for pair in query.split(['&', ';']) {
            if let Some((k, v)) = pair.split_once('=')
                && sensitive_param(k)
            {
                out.push(v.to_owned());
            }
        }
    }
    // Key/value connection strings (`host=h password=pw`).
    if !url.contains("://") {
        for word in url.split_whitespace() {
            if let Some((k, v)) = word.split_once('=')
                && sensitive_param(k)
            {
                out.push(v.trim_matches(['\'', '"']).to_owned());
            }
        }
    }
    let decoded: Vec<String> = out.iter().map(|s| percent_decode(s)).collect();
    out.extend(decoded);
    // Very short values would hide ordinary text; they are still masked inside URLs.
    out.retain(|s| s.len() >= 3 && s != "***");
    out
}

/// Hides a URL's password (`user:pw@`) and its token-like query parameters (`password`,
/// `sslpassword`, `token`, `secret`, `key`, `auth`, ...) before printing it.
pub fn redact(url: &str) -> String {
    let mut out = String::with_capacity(url.len());
    let mut rest_from = 0;
    if let Some((start, at)) = userinfo_at(url) {
        out.push_str(&url[..start]);
        match url[start..at].split_once(':') {
            Some((user, _)) => {
                out.push_str(user);
                out.push_str(":***");
            }
            None => out.push_str(&url[start..at]),
        }
        rest_from = at;
    }
    let rest = &url[rest_from..];
    let Some(q) = rest.find('?') else {
        if url.contains("://") {
            out.push_str(rest);
        } else {
            out.push_str(&redact_keywords(rest));
        }
        return out;
    };
    out.push_str(&rest[..=q]);
    let query = &rest[q + 1..];
    let (query, fragment) = match query.find('#') {
        Some(h) => query.split_at(h),
        None => (query, ""),
    };
    for piece in query.split_inclusive(['&', ';']) {
        let (pair, sep) = match piece.char_indices().last() {
            Some((i, c)) if c == '&' || c == ';' => (&piece[..i], &piece[i..]),
            _ => (piece, ""),
        };
        match pair.split_once('=') {
            Some((k, _)) if sensitive_param(k) => {
                out.push_str(k);
                out.push_str("=***");
            }
            _ => out.push_str(pair),
        }
        out.push_str(sep);
    }
    out.push_str(fragment);
    out
}

/// `key=value` words with a credential-like key masked (libpq keyword/value strings).
fn redact_keywords(s: &str) -> String {
    s.split_inclusive(char::is_whitespace)
        .map(|w| {
            let trimmed = w.trim_end();
            match trimmed.split_once('=') {
                Some((k, _)) if sensitive_param(k) => {
                    format!("{k}=***{}", &w[trimmed.len()..])
                }
                _ => w.to_owned(),
            }
        })
        .collect()
}

/// `text` with every URL in it redacted ([`redact`]) and every registered secret hidden.
pub fn scrub(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(sep) = rest.find("://") {
        let scheme_start = rest[..sep]
            .char_indices()
            .rev()
            .take_while(|(_, c)| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
            .last()
            .map_or(sep, |(i, _)| i);
        let end = rest[sep..]
            .find(|c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '`' | '<' | '>'))
            .map_or(rest.len(), |e| sep + e);
        // Punctuation that ends a sentence is not part of the URL (`at URL: cause`).
        let url = rest[scheme_start..end].trim_end_matches([':', ',', '.', ';', ')']);
        out.push_str(&rest[..scheme_start]);
        out.push_str(&redact(url));
        rest = &rest[scheme_start + url.len()..];
    }
    out.push_str(rest);
    for secret in SECRETS.get().map(Vec::as_slice).unwrap_or_default() {
        if out.contains(secret.as_str()) {
            out = out.replace(secret.as_str(), "***");
        }
    }
    out
}

/// The error chain on one line: each cause once (a message that already contains the next
/// cause's text makes that cause redundant), without PostgreSQL's internal source line
/// (`at line 3099`), with URLs and secrets hidden and control characters escaped.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = strip_source_lines(&cause.to_string());
        // sqlx's wrapper text, which says nothing `database error:` does not.
        let text = text.replace("error returned from database: ", "");
        let text = text.trim().to_owned();
        if text.is_empty() || parts.last().is_some_and(|prev| prev.contains(&text)) {
            continue;
        }
        parts.push(text);
    }
    cell(&scrub(&parts.join(": ")))
}

/// A suggestion for errors that mean pgfence's schema is missing or older than this
/// command: SQLSTATE 3F000 (no schema), 42883 (no function) or 42P01 (no table) about a
/// `pgfence` object.
pub fn hint(e: &anyhow::Error) -> &'static str {
    const HINT: &str = " (is the pgfence schema installed and current? run `pgfence migrate`)";
    for cause in e.chain() {
        let db = match cause.downcast_ref::<pgfence::Error>() {
            Some(pgfence::Error::TableNotFound(t)) if t.starts_with("pgfence.") => return HINT,
            Some(pgfence::Error::Backend(b)) => match b.as_sqlx() {
                Some(sqlx::Error::Database(db)) => db,
                _ => continue,
            },
            _ => match cause.downcast_ref::<sqlx::Error>() {
                Some(sqlx::Error::Database(db)) => db,
                _ => continue,
            },
        };
        if matches!(db.code().as_deref(), Some("3F000" | "42883" | "42P01"))
            && db.message().contains("pgfence")
        {
            return HINT;
        }
    }
    ""
}

/// Removes ` at line N` (the PostgreSQL server's C source line, from sqlx's error display).
fn strip_source_lines(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find(" at line ") {
        let after = &rest[i + " at line ".len()..];
        let digits = after.len() - after.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        out.push_str(&rest[..i]);
        if digits == 0 {
            out.push_str(" at line ");
        }
        rest = &after[digits..];
    }
    out.push_str(rest);
    out
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

/// Whether a write to stdout found it closed by its reader ([`write_out`]).
static STDOUT_CLOSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The error of a write to a stdout its reader closed (`pgfence audit | head`): the command
/// stops, and pgfence exits quietly ([`stdout_closed`]).
#[derive(Debug)]
pub struct StdoutClosed;

impl std::fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stdout was closed by its reader")
    }
}

impl std::error::Error for StdoutClosed {}

/// pgfence's exit code when its stdout was closed by the reader: 141 (128 + SIGPIPE), what a
/// shell reports for a command that a closed pipe stopped.
pub const CLOSED_STDOUT_EXIT: u8 = 141;

/// Whether stdout was found closed: the command's outcome is then not printed, and pgfence
/// exits with [`CLOSED_STDOUT_EXIT`].
pub fn stdout_closed() -> bool {
    STDOUT_CLOSED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Writes to stdout (what [`outln!`] and [`out!`] expand to): [`StdoutClosed`] when its
/// reader has gone, never a panic (`println!` panics on a closed pipe).
pub fn write_out(args: std::fmt::Arguments<'_>) -> Result<()> {
    use std::io::Write;
    match std::io::stdout().lock().write_fmt(args) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            STDOUT_CLOSED.store(true, std::sync::atomic::Ordering::Relaxed);
            Err(StdoutClosed.into())
        }
        Err(e) => Err(anyhow::Error::from(e).context("cannot write to stdout")),
    }
}

/// `println!` for command output: `outln!(...)?` stops the command when stdout is closed
/// ([`write_out`]).
macro_rules! outln {
    () => {
        $crate::util::write_out(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::util::write_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}
pub(crate) use outln;

/// `print!` for command output (see [`outln!`]).
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::util::write_out(format_args!($($arg)*))
    };
}
pub(crate) use out;

/// Prints rows as an aligned table.
pub fn print_table(headers: &[&str], rows: &[Vec<String>]) -> Result<()> {
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
        outln!("{}", padded.join("  ").trim_end())
    };
    line(headers.iter().map(|h| (*h).to_owned()).collect())?;
    for row in rows {
        line(row.clone())?;
    }
    Ok(())
}

/// Logs to stderr: pgfence's WARN and above by default (rejections are WARN), and only
/// errors from the libraries underneath (their warnings, such as sqlx's about unknown URL
/// parameters, are for `--verbose`); INFO and above from everything with `--verbose`. URLs
/// and secrets are hidden in every line.
pub fn init_logging(verbose: bool) {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = if verbose {
        Targets::new().with_default(LevelFilter::INFO)
    } else {
        Targets::new()
            .with_target("pgfence", LevelFilter::WARN)
            .with_default(LevelFilter::ERROR)
    };
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(|| ScrubbedStderr)
        .with_ansi(ansi)
        .with_target(true);
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(filter)
        .try_init();
}

/// Stderr for log events, with URLs and secrets hidden ([`scrub`]). The formatter writes each
/// event in one call, so a URL is never split between two writes.
struct ScrubbedStderr;

impl std::io::Write for ScrubbedStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = scrub(&String::from_utf8_lossy(buf));
        std::io::Write::write_all(&mut std::io::stderr(), text.as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::Write::flush(&mut std::io::stderr())
    }
}

/// `name` as a resource, or an error quoting it.
pub fn resource(name: &str) -> Result<pgfence::Resource> {
    pgfence::Resource::new(name)
        .with_context(|| format!("bad resource name {:?}", cell(&shorten(name))))
}

/// `name` (`table` or `schema.table`) as a table name, or an error quoting it.
pub fn table(name: &str) -> Result<pgfence::table::TableName> {
    pgfence::table::TableName::parse(name)
        .with_context(|| format!("bad table name {:?}", cell(&shorten(name))))
}

/// A role name as SQL reads it: `"Name"` as written (with `""` for a quote), an unquoted
/// name with ASCII letters folded to lower case.
pub fn role(name: &str) -> Result<pgfence::table::Ident> {
    let bad = || format!("bad role name {:?}", cell(&shorten(name)));
    let folded = match name.strip_prefix('"').and_then(|n| n.strip_suffix('"')) {
        Some(inner) if !inner.replace("\"\"", "").contains('"') => inner.replace("\"\"", "\""),
        Some(_) => anyhow::bail!("{}: stray quote", bad()),
        None if name.contains('"') => anyhow::bail!("{}: stray quote", bad()),
        None => name.to_ascii_lowercase(),
    };
    pgfence::table::Ident::new(folded).with_context(bad)
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
    fn roles_fold_like_sql() {
        assert_eq!(role("App_Role").unwrap().as_str(), "app_role");
        assert_eq!(role("\"App\"\"Role\"").unwrap().as_str(), "App\"Role");
        for bad in ["", "\"\"", "a\"b", "\"a\"b\"", &"r".repeat(64)] {
            assert!(role(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn redacts() {
        assert_eq!(redact("postgres://u:secret@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact("redis://h:6379"), "redis://h:6379");
        assert_eq!(redact("redis://:pw@h:6379/0"), "redis://:***@h:6379/0");
        assert_eq!(
            redact("postgres://app@host/db?password=hunter2&sslmode=require"),
            "postgres://app@host/db?password=***&sslmode=require"
        );
        assert_eq!(
            redact("postgres://h/db?sslmode=disable&SSLPassword=x;api_token=y&Auth=z#frag"),
            "postgres://h/db?sslmode=disable&SSLPassword=***;api_token=***&Auth=***#frag"
        );
        assert_eq!(
            redact("postgres://u:p@h/db?pass%77ord=x"),
            "postgres://u:***@h/db?pass%77ord=***"
        );
        // A raw '/' or '?' in the password still hides it.
        assert_eq!(redact("postgres://u:a/b?c@h/db"), "postgres://u:***@h/db");
        assert_eq!(
            redact("host=h password=hunter2 user=u"),
            "host=h password=*** user=u"
        );
        assert_eq!(redact("not a url"), "not a url");
        assert_eq!(redact(""), "");
        assert_eq!(redact("é://@?&=;#"), "é://@?&=;#");
    }

    #[test]
    fn scrubs_urls_in_text() {
        assert_eq!(
            scrub("cannot connect at postgres://u:pw@h/db?token=abc: refused"),
            "cannot connect at postgres://u:***@h/db?token=***: refused"
        );
        assert_eq!(scrub("x \"redis://:pw@h\" y"), "x \"redis://:***@h\" y");
        assert_eq!(scrub("no urls here: a=b"), "no urls here: a=b");
        let secrets = secrets_of("postgres://u:s%40cret@h/db?password=hunter2&x=1");
        for s in ["s%40cret", "s@cret", "hunter2"] {
            assert!(secrets.contains(&s.to_owned()), "{s}: {secrets:?}");
        }
        assert!(!secrets.contains(&"1".to_owned()));
    }

    #[test]
    fn one_line_dedupes_the_chain_and_strips_source_lines() {
        #[derive(Debug)]
        struct Leaf;
        impl std::fmt::Display for Leaf {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("schema \"pgfence\" does not exist at line 3099")
            }
        }
        impl std::error::Error for Leaf {}
        #[derive(Debug)]
        struct Mid(Leaf);
        impl std::fmt::Display for Mid {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "error returned from database: {}", self.0)
            }
        }
        impl std::error::Error for Mid {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = anyhow::Error::new(Mid(Leaf)).context("database error: error returned from database: schema \"pgfence\" does not exist at line 3099");
        assert_eq!(
            one_line(&e),
            "database error: schema \"pgfence\" does not exist"
        );
        let e = anyhow::anyhow!("refused\nforged").context("cannot connect to redis://:pw@h");
        assert_eq!(
            one_line(&e),
            "cannot connect to redis://:***@h: refused\\nforged"
        );
        assert_eq!(
            strip_source_lines("a at line 12: b at line x"),
            "a: b at line x"
        );
    }
}
