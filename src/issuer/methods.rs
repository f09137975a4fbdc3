//! The lease methods every issuer has (`acquire`, `acquire_as`, `acquire_wait`, `release`,
//! `extend`, `extend_until`, `status`, `keep_alive`), written once: [`issuer_methods!`]
//! generates them, with their docs, for each backend type as plain `async fn`s calling the
//! policy ([`super::policy`]). A backend adds only what is its own (how its store rounds a
//! TTL, what its `retry_in` or `counter` means) as notes to the shared docs.

/// Generates the lease methods of an issuer backend, with their shared docs.
///
/// ```ignore
/// issuer_methods! {
///     impl[] PgIssuer {
///         error: "[`Error::Backend`](crate::Error::Backend)",
///         acquire: { /// notes appended to the shared docs, before `# Errors` }
///         acquire_as: {}
///         acquire_wait: {}
///         release: {}
///         extend: {}
///         status: {}
///     }
/// }
/// ```
///
/// `impl[...]` holds the impl's generic parameters (empty for a plain type); `error` is the
/// store's error, as the Errors sections name it. The type needs `Clone` (for `keep_alive`)
/// and [`Backend`](super::policy::Backend).
macro_rules! issuer_methods {
    (
        impl[$($generics:tt)*] $ty:ty {
            error: $error:literal,
            acquire: { $(#[$acquire:meta])* }
            acquire_as: { $(#[$acquire_as:meta])* }
            acquire_wait: { $(#[$acquire_wait:meta])* }
            release: { $(#[$release:meta])* }
            extend: { $(#[$extend:meta])* }
            status: { $(#[$status:meta])* }
        }
    ) => {
        impl<$($generics)*> $ty {
            /// Tries once to take `resource`'s lock for `ttl`. `Ok(None)` when another owner
            /// holds it.
            $(#[$acquire])*
            ///
            /// # Errors
            /// [`InvalidInput::Duration`](crate::error::InvalidInput::Duration) for a TTL outside
            /// [`MIN_TTL`](crate::issuer::limits::MIN_TTL)`..=`[`MAX_TTL`](crate::issuer::limits::MAX_TTL)
            /// (nothing is sent); [`InvalidInput::Token`](crate::error::InvalidInput::Token) when the
            /// token would pass [`MAX_TOKEN`](crate::token::MAX_TOKEN) (the acquire is refused
            /// and leaves no lock behind);
            #[doc = concat!(" ", $error, " when the store fails after re-sends.")]
            pub async fn acquire(
                &self,
                resource: &$crate::Resource,
                ttl: ::std::time::Duration,
            ) -> $crate::Result<Option<$crate::issuer::Lease>> {
                $crate::issuer::policy::acquire(self, resource, ttl).await
            }

            /// Like [`acquire`](Self::acquire) with a caller-chosen owner id (such as
            /// [`Lease::new_owner_id`](crate::issuer::Lease::new_owner_id)). Re-running it with
            /// the same owner while the lease is held returns the same token and renews the
            /// lock for `ttl` (the idempotent retry after a lost reply). `Err(retry_in)` when
            /// another owner holds the lock.
            $(#[$acquire_as])*
            ///
            /// # Errors
            /// As [`acquire`](Self::acquire); [`InvalidInput::Owner`](crate::error::InvalidInput::Owner)
            /// for an empty owner id or one containing `:`.
            pub async fn acquire_as(
                &self,
                resource: &$crate::Resource,
                owner: &str,
                ttl: ::std::time::Duration,
            ) -> $crate::Result<::std::result::Result<$crate::issuer::Lease, ::std::time::Duration>>
            {
                $crate::issuer::policy::acquire_as(self, resource, owner, ttl).await
            }

            /// Waits up to `wait` for the lock, retrying with one owner id and jittered
            /// exponential backoff (10 ms doubling to 500 ms, never sleeping past the holder's
            /// remaining TTL where the store reports it), also through retryable errors (a
            /// failover, a restart). `Ok(None)` when the wait ran out.
            $(#[$acquire_wait])*
            ///
            /// # Errors
            /// As [`acquire`](Self::acquire).
            pub async fn acquire_wait(
                &self,
                resource: &$crate::Resource,
                ttl: ::std::time::Duration,
                wait: ::std::time::Duration,
            ) -> $crate::Result<Option<$crate::issuer::Lease>> {
                $crate::issuer::policy::acquire_wait(self, resource, ttl, wait).await
            }

            /// Releases the lock if `lease` (owner and token) still holds it.
            ///
            /// A release lost in transit is sent again within the call bound
            /// ([`with_call_timeout`](Self::with_call_timeout)): releasing is owner-safe. When a
            /// re-sent release finds the lock gone before the lease's local deadline, the lock
            /// cannot have expired, so an earlier attempt released it: that is reported as
            /// [`ReleaseOutcome::Released`](crate::issuer::ReleaseOutcome::Released).
            $(#[$release])*
            ///
            /// # Errors
            #[doc = concat!(" ", $error, ".")]
            pub async fn release(
                &self,
                lease: &$crate::issuer::Lease,
            ) -> $crate::Result<$crate::issuer::ReleaseOutcome> {
                $crate::issuer::policy::release(self, lease).await
            }

            /// Extends the lock to `ttl` from now if `lease` still holds it
            /// ([`LeaseState::Held`](crate::issuer::LeaseState::Held)), and moves the lease's
            /// local deadline accordingly.
            ///
            /// An extend lost in transit is sent again (extending is owner-safe and idempotent)
            /// within the call bound ([`with_call_timeout`](Self::with_call_timeout)); only the
            /// store's answer ([`LeaseState::Expired`](crate::issuer::LeaseState::Expired),
            /// [`LeaseState::Taken`](crate::issuer::LeaseState::Taken)) or running out of time
            /// ends it early.
            $(#[$extend])*
            ///
            /// # Errors
            /// [`InvalidInput::Duration`](crate::error::InvalidInput::Duration);
            #[doc = concat!(" ", $error, ".")]
            pub async fn extend(
                &self,
                lease: &mut $crate::issuer::Lease,
                ttl: ::std::time::Duration,
            ) -> $crate::Result<$crate::issuer::LeaseState> {
                $crate::issuer::policy::extend(self, lease, ttl).await
            }

            /// [`extend`](Self::extend), re-sending after transport failures only until
            /// `until` (what [`KeepAlive`](crate::issuer::KeepAlive) uses, with the lease's
            /// local deadline).
            ///
            /// # Errors
            /// As [`extend`](Self::extend).
            pub async fn extend_until(
                &self,
                lease: &mut $crate::issuer::Lease,
                ttl: ::std::time::Duration,
                until: ::tokio::time::Instant,
            ) -> $crate::Result<$crate::issuer::LeaseState> {
                $crate::issuer::policy::extend_until(self, lease, ttl, until).await
            }

            /// Reads `resource`'s lock (a lapsed one reads as free) and counter. A read lost
            /// in transit is sent again within the call bound.
            $(#[$status])*
            ///
            /// # Errors
            #[doc = concat!(" ", $error, ".")]
            pub async fn status(
                &self,
                resource: &$crate::Resource,
            ) -> $crate::Result<$crate::issuer::LockStatus> {
                $crate::issuer::policy::status(self, resource).await
            }

            /// Keeps `lease` alive in the background; see
            /// [`KeepAlive`](crate::issuer::KeepAlive).
            #[must_use]
            pub fn keep_alive(&self, lease: &$crate::issuer::Lease) -> $crate::issuer::KeepAlive {
                $crate::issuer::KeepAlive::spawn(
                    ::std::sync::Arc::new(::std::clone::Clone::clone(self)),
                    ::std::clone::Clone::clone(lease),
                )
            }
        }
    };
}

pub(super) use issuer_methods;
