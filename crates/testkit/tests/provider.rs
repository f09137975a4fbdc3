//! The fake payment provider honours `Idempotency-Key` as payment APIs do.

use std::time::Duration;

use pgfence_testkit::Provider;
use pgfence_testkit::provider::charge;

const T: Duration = Duration::from_secs(5);

#[test]
fn a_key_charges_once_and_replays_its_answer() {
    let p = Provider::start(Duration::ZERO).unwrap();
    let first = charge(&p.url(), Some("k1"), "inv-1", 100, T).unwrap();
    assert_eq!(first.status, 200);
    assert!(first.body.contains(r#""item":"inv-1""#), "{}", first.body);
    assert!(!first.replayed);
    let again = charge(&p.url(), Some("k1"), "inv-1", 100, T).unwrap();
    assert_eq!(
        (again.status, again.body.as_str(), again.replayed),
        (200, first.body.as_str(), true)
    );
    assert_eq!(p.charges("inv-1"), 1);
    // The same key with another body is refused; another key charges again.
    assert_eq!(
        charge(&p.url(), Some("k1"), "inv-1", 999, T)
            .unwrap()
            .status,
        422
    );
    charge(&p.url(), Some("k2"), "inv-1", 100, T).unwrap();
    assert_eq!(p.charges("inv-1"), 2);
    assert_eq!(p.duplicates(), [("inv-1".to_owned(), 2)]);
    assert_eq!(p.counts(), (4, 1, 0));
}

#[test]
fn a_concurrent_duplicate_gets_a_conflict_and_no_key_charges_every_time() {
    let p = Provider::start(Duration::from_millis(300)).unwrap();
    let url = p.url();
    let slow = std::thread::spawn(move || charge(&url, Some("k"), "inv-2", 5, T).unwrap());
    std::thread::sleep(Duration::from_millis(100));
    let dup = charge(&p.url(), Some("k"), "inv-2", 5, T).unwrap();
    assert_eq!(dup.status, 409, "{}", dup.body);
    assert_eq!(slow.join().unwrap().status, 200);
    assert_eq!(p.charges("inv-2"), 1);
    p.set_latency(Duration::ZERO);
    for _ in 0..3 {
        assert_eq!(charge(&p.url(), None, "inv-3", 1, T).unwrap().status, 200);
    }
    assert_eq!(p.charges("inv-3"), 3, "no key, no deduplication");
    let bad = charge("http://127.0.0.1:1", None, "x", 1, T);
    assert!(bad.is_err());
}
