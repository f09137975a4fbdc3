//! The one parser of the `DETAIL` pgfence's SQL puts on its rejections (PF001, PF004,
//! PF005, PF008, PF009): docs/sql.md, "SQLSTATEs".

use super::sqlstate::{DUPLICATE, FAILED_OVER, SEALED, STALE, TOKEN_JUMP};
use super::{Error, StaleTarget};

/// The `DETAIL` of an error pgfence's SQL raised (docs/sql.md, "SQLSTATEs"): `name=value`
/// fields separated by spaces, then the target, `resource=<name>` or `table=<name>`, to the
/// end (a name may contain spaces).
struct Detail<'a> {
    fields: Vec<(&'a str, &'a str)>,
    target: StaleTarget,
}

impl<'a> Detail<'a> {
    fn parse(detail: &'a str) -> Option<Self> {
        let mut fields = Vec::new();
        let mut rest = detail;
        loop {
            if let Some(name) = rest.strip_prefix("resource=") {
                let target = StaleTarget::Resource(name.to_owned());
                return Some(Self { fields, target });
            }
            if let Some(name) = rest.strip_prefix("table=") {
                let target = StaleTarget::Table(name.to_owned());
                return Some(Self { fields, target });
            }
            let (field, tail) = rest.split_once(' ')?;
            fields.push(field.split_once('=')?);
            rest = tail;
        }
    }

    fn get(&self, name: &str) -> Option<&'a str> {
        self.fields
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| *v)
    }

    fn num(&self, name: &str) -> Option<i64> {
        self.get(name)?.parse().ok()
    }
}

/// The typed error for a pgfence SQLSTATE whose `DETAIL` says who was refused
/// (`PF001`, `PF004`, `PF005`, `PF008`, `PF009`); `None` for another code or a `DETAIL` that
/// does not parse.
pub(super) fn from_detail(code: &str, detail: &str) -> Option<Error> {
    let d = Detail::parse(detail)?;
    let presented = d.num("presented")?;
    Some(match code {
        STALE => Error::StaleToken {
            presented,
            current: d.num("current")?,
            other_counter: d.get("origin") == Some("other"),
            target: d.target,
        },
        DUPLICATE => Error::DuplicateToken {
            target: d.target,
            token: presented,
        },
        SEALED => Error::RowSealed {
            target: d.target,
            token: presented,
        },
        TOKEN_JUMP => Error::TokenJump {
            presented,
            current: d.num("current")?,
            max_jump: d.num("max_jump")?,
            target: d.target,
        },
        FAILED_OVER => Error::FencedByFailover {
            presented,
            lease_timeline: d.num("lease_timeline")?,
            timeline: d.num("timeline")?,
            target: d.target,
        },
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_token_jump_detail() {
        let e = from_detail(
            "PF008",
            "presented=549755813887 current=5 max_jump=68719476736 table=\"public\".\"t\"",
        )
        .unwrap();
        assert!(
            matches!(e, Error::TokenJump { presented: 549_755_813_887, current: 5, max_jump: 68_719_476_736, target: StaleTarget::Table(ref t) } if t == "\"public\".\"t\""),
            "{e:?}"
        );
        let e = from_detail("PF008", "presented=9 current=1 max_jump=2 resource=a:b").unwrap();
        assert!(
            matches!(e, Error::TokenJump { target: StaleTarget::Resource(ref r), .. } if r == "a:b")
        );
        assert!(from_detail("PF008", "presented=x current=1 max_jump=2 resource=a").is_none());
        assert!(from_detail("PF008", "nonsense").is_none());
    }

    #[test]
    fn parses_failover_detail() {
        let e = from_detail(
            "PF009",
            "presented=4 lease_timeline=1 timeline=2 resource=a:b",
        )
        .unwrap();
        assert!(
            matches!(e, Error::FencedByFailover { presented: 4, lease_timeline: 1, timeline: 2, target: StaleTarget::Resource(ref r) } if r == "a:b"),
            "{e:?}"
        );
        assert!(e.to_string().contains("timeline 2"), "{e}");
        assert!(
            from_detail(
                "PF009",
                "presented=4 lease_timeline=x timeline=2 resource=a"
            )
            .is_none()
        );
    }

    #[test]
    fn parses_trigger_detail() {
        let e = from_detail("PF001", "presented=1 current=2 table=\"public\".\"t\"").unwrap();
        assert!(
            matches!(e, Error::StaleToken { presented: 1, current: 2, other_counter: false, target: StaleTarget::Table(ref t) } if t == "\"public\".\"t\"")
        );
        let e = from_detail("PF004", "presented=3 current=3 resource=a:b").unwrap();
        assert!(
            matches!(e, Error::DuplicateToken { token: 3, target: StaleTarget::Resource(ref r) } if r == "a:b")
        );
        let e = from_detail("PF001", "presented=1 current=9 origin=other resource=r").unwrap();
        assert!(matches!(
            e,
            Error::StaleToken {
                other_counter: true,
                ..
            }
        ));
        assert!(e.to_string().contains("fencing domain"), "{e}");
        assert!(from_detail("PF001", "garbage").is_none());
    }
}
