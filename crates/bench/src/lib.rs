//! The throughput benchmark of pgfence: `cargo bench --bench throughput` (see `BENCHMARKS.md`;
//! the benchmark itself is `benches/throughput/`).
//!
//! This library holds the benchmark's pure helpers — key generation, parsing of the external
//! tools' output, statistics — so that `cargo test -p pgfence-bench` checks them without
//! servers.

/// SplitMix64: a tiny, fast, seedable generator; good enough to pick keys.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (multiply-shift; the bias is far below what matters here).
    ///
    /// # Panics
    /// Never: the result is below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        u64::try_from((u128::from(self.next_u64()) * u128::from(n)) >> 64).expect("less than n")
    }
}

/// The step that spreads a batch over a task's `slots` key slots: batch row `j` of a batch
/// starting at slot `start` takes slot [`spread_slot`]`(start, j, step, slots)`. The step is
/// coprime with `slots`, so a batch of at most `slots` rows never names a slot twice, and
/// close to `slots × 0.618`, so that consecutive rows of a batch land far apart in the table
/// (not on the same few pages). The Rust batch rows and the pgbench ceiling use the same keys.
#[must_use]
pub fn spread_step(slots: u64) -> u64 {
    if slots <= 1 {
        return 1;
    }
    let mut step = (slots * 618 / 1000).max(1);
    while gcd(step, slots) != 1 {
        step += 1;
    }
    step
}

/// Slot of batch row `j` (see [`spread_step`]).
#[must_use]
pub fn spread_slot(start: u64, j: u64, step: u64, slots: u64) -> u64 {
    let slot = (u128::from(start) + u128::from(j) * u128::from(step)) % u128::from(slots.max(1));
    u64::try_from(slot).expect("less than slots")
}

/// Greatest common divisor.
fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The median of `v` (the mean of the middle two for an even count), `None` when empty.
#[must_use]
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// The number after `prefix` on the first line of `text` that starts with it (leading blanks
/// ignored), as in pgbench's `tps = 1234.5 (without initial connection time)`.
#[must_use]
pub fn number_after(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.trim().strip_prefix(prefix))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// `url` with its database replaced by `db` (user, host, port and parameters kept).
///
/// # Errors
/// When `url` has no `scheme://`.
pub fn with_database(url: &str, db: &str) -> Result<String, String> {
    let scheme_end = url
        .find("://")
        .ok_or_else(|| "DATABASE_URL is not a URL".to_owned())?
        + 3;
    let rest = &url[scheme_end..];
    let (main, query) = rest.find('?').map_or((rest, ""), |i| rest.split_at(i));
    let authority = main.find('/').map_or(main, |i| &main[..i]);
    Ok(format!("{}{authority}/{db}{query}", &url[..scheme_end]))
}

/// `sql` for a pgbench script: its parameters `$1..$n` replaced by pgbench variables, `$i`
/// by `names[i - 1]` (`":id"`...).
///
/// # Errors
/// When `sql` has a `$` left over: a parameter beyond `names`, or a dollar-quoted string.
pub fn pgbench_params(sql: &str, names: &[&str]) -> Result<String, String> {
    // Highest first, so that `$1` does not eat the start of `$10`.
    let body = names
        .iter()
        .enumerate()
        .rev()
        .fold(sql.to_owned(), |s, (i, name)| {
            s.replace(&format!("${}", i + 1), name)
        });
    if body.contains('$') {
        return Err(format!(
            "unexpected parameter in the SQL (expected $1..${}): {sql}",
            names.len()
        ));
    }
    Ok(body)
}

/// `(ppid, utime + stime, cutime + cstime)` from the contents of a `/proc/<pid>/stat` file,
/// in clock ticks.
#[must_use]
pub fn parse_proc_stat(stat: &str) -> Option<(u32, u64, u64)> {
    // Fields after the command name (which may contain spaces and parentheses): state ppid
    // ...; utime is field 14 of the line.
    let fields: Vec<&str> = stat
        .get(stat.rfind(')')? + 2..)?
        .split_whitespace()
        .collect();
    let num = |i: usize| fields.get(i)?.parse::<u64>().ok();
    Some((
        fields.get(1)?.parse().ok()?,
        num(11)? + num(12)?,
        num(13)? + num(14)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_stays_in_range_and_is_seeded() {
        let (mut a, mut b) = (SplitMix64(7), SplitMix64(7));
        for _ in 0..1000 {
            let x = a.below(10);
            assert!(x < 10);
            assert_eq!(x, b.below(10));
        }
    }

    #[test]
    fn batches_spread_without_repeating_a_slot() {
        for slots in [1_u64, 2, 10, 625, 1000, 1024, 62_500] {
            let step = spread_step(slots);
            assert_eq!(gcd(step, slots), 1, "slots {slots}");
            for start in [0, slots / 3, slots - 1] {
                let mut seen: Vec<u64> = (0..slots)
                    .map(|j| spread_slot(start, j, step, slots))
                    .collect();
                assert!(seen.iter().all(|&s| s < slots));
                seen.sort_unstable();
                seen.dedup();
                assert_eq!(seen.len() as u64, slots, "slots {slots}, start {start}");
            }
        }
        // Consecutive rows land far apart.
        let step = spread_step(625);
        assert!(step > 300 && step < 400, "{step}");
    }

    #[test]
    fn median_of_odd_even_empty() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(vec![]), None);
    }

    #[test]
    fn numbers_from_pgbench_output() {
        let out = "number of transactions actually processed: 1234\n\
                   latency average = 0.812 ms\n\
                   tps = 19702.123456 (without initial connection time)\n";
        assert_eq!(number_after(out, "tps ="), Some(19_702.123_456));
        assert_eq!(number_after(out, "latency average ="), Some(0.812));
        assert_eq!(
            number_after(out, "number of transactions actually processed:"),
            Some(1234.0)
        );
        assert_eq!(number_after(out, "number of failed transactions:"), None);
    }

    #[test]
    fn database_replaced() {
        let f = |u| with_database(u, "bench").unwrap();
        assert_eq!(
            f("postgres://postgres@127.0.0.1/postgres"),
            "postgres://postgres@127.0.0.1/bench"
        );
        assert_eq!(f("postgres://u:p@h:5433"), "postgres://u:p@h:5433/bench");
        assert_eq!(
            f("postgres://h/db?sslmode=disable"),
            "postgres://h/bench?sslmode=disable"
        );
        assert!(with_database("nope", "bench").is_err());
    }

    #[test]
    fn parameters_become_variables() {
        let names = [":id", ":payload", ":tok"];
        assert_eq!(
            pgbench_params(
                "UPDATE t SET p = $2, f = $3 WHERE id = $1 AND f < $3",
                &names
            )
            .unwrap(),
            "UPDATE t SET p = :payload, f = :tok WHERE id = :id AND f < :tok"
        );
        let many: Vec<String> = (1..=10).map(|i| format!(":v{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert_eq!(pgbench_params("$10 $1", &many).unwrap(), ":v10 :v1");
        assert!(pgbench_params("SELECT $4", &names).is_err());
        // The repository's statements bind the lease's timeline last, and use it twice.
        let names = [":id", ":payload", ":tok", ":timeline"];
        assert_eq!(
            pgbench_params(
                "UPDATE t SET p = $2 WHERE id = $1 AND f < $3 AND ($4::int8 = 0 OR $4::int8 = tl())",
                &names
            )
            .unwrap(),
            "UPDATE t SET p = :payload WHERE id = :id AND f < :tok \
             AND (:timeline::int8 = 0 OR :timeline::int8 = tl())"
        );
    }

    #[test]
    fn proc_stat_fields() {
        let stat = "4242 (postgres: a (b)) S 17 4242 4242 0 -1 4194560 100 0 0 0 \
                    250 50 7 3 20 0 1 0 100 0 0";
        assert_eq!(parse_proc_stat(stat), Some((17, 300, 10)));
        assert_eq!(parse_proc_stat("garbage"), None);
    }
}
