//! TLS plumbing shared by the issuers that pgfence connects itself (Redis standalone, Sentinel
//! and Cluster; etcd): pgfence's TLS URL parameters, reading the files they name, and the
//! process-level rustls crypto provider.
//!
//! # URL parameters
//!
//! A TLS issuer URL (`rediss://`, `rediss+sentinel://`, `etcd+https://`) takes these query
//! parameters, named as `redis-cli`'s and `etcdctl`'s flags and percent-decoded:
//!
//! * `cacert=PATH`: the CA certificate(s) (PEM) that sign the server's certificate. Without it
//!   the system trust store is used.
//! * `cert=PATH` and `key=PATH`: a client certificate chain and its private key (PEM), for
//!   servers that require client certificates (mutual TLS). One without the other is an error.
//!
//! pgfence removes them from the URL before the client library sees it. They are refused on a
//! URL that is not TLS (`redis://`, `redis+sentinel://`, `etcd://`): a CA file on a plaintext
//! connection would silently protect nothing. The files are read once, when connecting; to
//! pick up rotated certificates, connect again.

use crate::error::InvalidInput;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The query parameters pgfence reads for TLS.
const PARAMS: [&str; 3] = ["cacert", "cert", "key"];

/// pgfence's TLS parameters of one URL (file paths, not read yet).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct TlsParams {
    /// `cacert=`: CA certificates (PEM) to trust instead of the system store.
    pub(crate) cacert: Option<PathBuf>,
    /// `cert=`: the client certificate chain (PEM).
    pub(crate) cert: Option<PathBuf>,
    /// `key=`: the client certificate's private key (PEM).
    pub(crate) key: Option<PathBuf>,
}

/// The contents of the files [`TlsParams`] name, checked to hold what they should.
#[derive(Clone, Default)]
pub(crate) struct TlsFiles {
    /// The CA certificates (PEM), when `cacert` was given.
    pub(crate) ca: Option<Vec<u8>>,
    /// The client certificate chain and key (PEM), when `cert` and `key` were given.
    pub(crate) identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsFiles")
            .field("ca", &self.ca.is_some())
            .field("identity", &self.identity.is_some())
            .finish()
    }
}

impl TlsParams {
    /// No TLS parameter was given.
    pub(crate) fn is_empty(&self) -> bool {
        self.cacert.is_none() && self.cert.is_none() && self.key.is_none()
    }

    /// Takes pgfence's TLS parameters (`cacert`, `cert`, `key`) out of `url`'s query: the URL
    /// without them (other parameters and a `#fragment` kept, in order) and the parameters.
    ///
    /// # Errors
    /// [`InvalidInput::Tls`](crate::error::InvalidInput::Tls) for a parameter given twice or empty, a value that is not valid
    /// percent-encoded UTF-8, or `cert` without `key` (or the reverse).
    pub(crate) fn split(url: &str) -> Result<(String, Self)> {
        let (rest, fragment) = match url.split_once('#') {
            Some((r, f)) => (r, Some(f)),
            None => (url, None),
        };
        let Some((base, query)) = rest.split_once('?') else {
            return Ok((url.to_owned(), Self::default()));
        };
        let mut params = Self::default();
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let slot = match name {
                "cacert" => &mut params.cacert,
                "cert" => &mut params.cert,
                "key" => &mut params.key,
                _ => {
                    kept.push(pair);
                    continue;
                }
            };
            let value = percent_decode(value).ok_or_else(|| {
                Error::Invalid(InvalidInput::Tls(format!(
                    "the value of `{name}` is not valid percent-encoded UTF-8"
                )))
            })?;
            if value.is_empty() {
                return Err(Error::Invalid(InvalidInput::Tls(format!(
                    "`{name}` names no file"
                ))));
            }
            if slot.replace(PathBuf::from(value)).is_some() {
                return Err(Error::Invalid(InvalidInput::Tls(format!(
                    "`{name}` is given twice"
                ))));
            }
        }
        match (&params.cert, &params.key) {
            (Some(_), None) => {
                return Err(Error::Invalid(InvalidInput::Tls(
                    "`cert` (a client certificate) needs `key`, its private key".into(),
                )));
            }
            (None, Some(_)) => {
                return Err(Error::Invalid(InvalidInput::Tls(
                    "`key` (a client private key) needs `cert`, its certificate".into(),
                )));
            }
            _ => {}
        }
        let mut stripped = base.to_owned();
        if !kept.is_empty() {
            stripped.push('?');
            stripped.push_str(&kept.join("&"));
        }
        if let Some(fragment) = fragment {
            stripped.push('#');
            stripped.push_str(fragment);
        }
        Ok((stripped, params))
    }

    /// Refuses TLS parameters on a URL that is not TLS: `tls_scheme` names the scheme to use
    /// instead (`rediss://`, `etcd+https://`).
    ///
    /// # Errors
    /// [`InvalidInput::Tls`](crate::error::InvalidInput::Tls) when any parameter was given.
    pub(crate) fn refuse_on_plain(&self, scheme: &str, tls_scheme: &str) -> Result<()> {
        if self.is_empty() {
            return Ok(());
        }
        let given: Vec<&str> = PARAMS
            .iter()
            .zip([&self.cacert, &self.cert, &self.key])
            .filter(|(_, v)| v.is_some())
            .map(|(name, _)| *name)
            .collect();
        Err(Error::Invalid(InvalidInput::Tls(format!(
            "{} {}, but {scheme} connects without TLS: use {tls_scheme}",
            given
                .iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", "),
            if given.len() == 1 {
                "is a TLS setting"
            } else {
                "are TLS settings"
            },
        ))))
    }

    /// Reads the files and checks that the CA file holds certificates, the `cert` file a
    /// certificate chain and the `key` file a private key (PEM).
    ///
    /// # Errors
    /// [`InvalidInput::TlsFile`](crate::error::InvalidInput::TlsFile) naming the parameter and the file that could not be read, or that
    /// does not hold what it should.
    pub(crate) fn read(&self) -> Result<TlsFiles> {
        let ca = self
            .cacert
            .as_deref()
            .map(|path| read_pem(path, "cacert", Pem::Certificates))
            .transpose()?;
        let identity = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => Some((
                read_pem(cert, "cert", Pem::Certificates)?,
                read_pem(key, "key", Pem::PrivateKey)?,
            )),
            _ => None,
        };
        Ok(TlsFiles { ca, identity })
    }
}

/// What a PEM file must hold.
#[derive(Clone, Copy)]
enum Pem {
    Certificates,
    PrivateKey,
}

fn read_pem(path: &Path, param: &'static str, want: Pem) -> Result<Vec<u8>> {
    let file_error = |reason: String| {
        Error::Invalid(InvalidInput::TlsFile {
            param,
            path: path.to_owned(),
            reason,
        })
    };
    let bytes = std::fs::read(path).map_err(|e| file_error(e.to_string()))?;
    check_pem(&bytes, want).map_err(file_error)?;
    Ok(bytes)
}

/// Checks the PEM with rustls's parser (the one the TLS stack will use).
#[cfg(feature = "tls")]
fn check_pem(bytes: &[u8], want: Pem) -> std::result::Result<(), String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    match want {
        Pem::Certificates => {
            let mut count = 0;
            for cert in CertificateDer::pem_slice_iter(bytes) {
                cert.map_err(|e| format!("not a PEM certificate file: {e}"))?;
                count += 1;
            }
            if count == 0 {
                return Err("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into());
            }
        }
        Pem::PrivateKey => {
            PrivateKeyDer::from_pem_slice(bytes)
                .map_err(|e| format!("holds no PEM private key: {e}"))?;
        }
    }
    Ok(())
}

/// Without the `tls` feature nothing reads the files: only a rough check.
#[cfg(not(feature = "tls"))]
fn check_pem(bytes: &[u8], _want: Pem) -> std::result::Result<(), String> {
    if bytes.windows(11).any(|w| w == b"-----BEGIN ") {
        Ok(())
    } else {
        Err("holds no PEM block (-----BEGIN ...)".into())
    }
}

/// Installs rustls's `ring` provider as the process's default crypto provider when there is
/// none yet (a race with another installer is harmless: one of them wins, and either will do).
///
/// redis-rs builds its rustls configuration with `ClientConfig::builder()`, which uses the
/// process default and panics when none is installed and the process has zero or two
/// providers compiled in ("Could not automatically determine the process-level
/// CryptoProvider"). Called before every TLS connection pgfence sets up, so that pgfence
/// never panics on the caller's behalf; a provider the application installed itself is left
/// alone.
#[cfg(feature = "tls")]
pub(crate) fn ensure_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        let _ = ring_provider().install_default();
    }
}

/// rustls's `ring` provider.
///
/// rustls 0.23.48 deprecates `ring::default_provider` ("no support for post-quantum
/// algorithms", pointing at aws-lc-rs, which needs cmake) and gives 0.23 no other way to make
/// ring's provider: the selection from crate features that `ClientConfig::builder()` does is
/// private, and panics when two providers are compiled in, which is the case this function is
/// for. So the call is allowed here, once, instead of copying rustls's tables; with the
/// version `Cargo.lock` pins (0.23.46) it is not deprecated at all. rustls 0.24 moves ring to
/// the `rustls-ring` crate: the place to change then.
#[cfg(feature = "tls")]
#[allow(deprecated)]
fn ring_provider() -> rustls::crypto::CryptoProvider {
    rustls::crypto::ring::default_provider()
}

/// Decodes `%XX` escapes (no `+` to space: these are URLs, not forms). `None` for a bad escape
/// or bytes that are not UTF-8.
pub(crate) fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Whether `url`'s scheme is `scheme` (given with its `://`), ignoring case.
pub(crate) fn has_scheme(url: &str, scheme: &str) -> bool {
    url.get(..scheme.len())
        .is_some_and(|s| s.eq_ignore_ascii_case(scheme))
}

/// The URL schemes that ask for ZooKeeper over TLS, which pgfence does not speak (see
/// `ZkIssuer`, "No TLS").
const ZK_TLS_SCHEMES: [&str; 3] = ["zks://", "zk+tls://", "zk+ssl://"];

/// Whether `url` asks for ZooKeeper over TLS by its scheme.
pub(crate) fn is_zk_tls_url(url: &str) -> bool {
    ZK_TLS_SCHEMES.iter().any(|scheme| has_scheme(url, scheme))
}

/// The error for a ZooKeeper URL that asks for TLS.
pub(crate) fn zk_tls_unsupported() -> Error {
    Error::TlsUnsupported {
        issuer: "ZooKeeper",
        scheme: "zk://",
    }
}

/// The error for a TLS URL in a build without the `tls` feature.
#[cfg(not(feature = "tls"))]
pub(crate) fn not_built(scheme: &'static str) -> Error {
    Error::IssuerNotBuilt {
        scheme,
        feature: "tls",
    }
}

/// A URL redis-rs refused to parse, as the one invalid-URL error every issuer reports (the
/// client is only built here; nothing has been sent): its host and what is wrong, never the
/// password.
fn bad_redis_url(url: &str) -> impl FnOnce(redis::RedisError) -> Error + '_ {
    move |e| crate::issuer::invalid_redis_url(Some(url), &e)
}

/// A redis-rs client for `url` (`redis://`, `rediss://`, `redis+unix://`, `unix://`), with
/// pgfence's TLS parameters applied ([`TlsParams`]).
///
/// # Errors
/// [`InvalidInput::Tls`](crate::error::InvalidInput::Tls) / [`InvalidInput::TlsFile`](crate::error::InvalidInput::TlsFile) for the TLS parameters;
/// [`Error::IssuerNotBuilt`] for `rediss://` without the `tls` feature;
/// [`InvalidInput::IssuerUrl`](crate::error::InvalidInput::IssuerUrl) for a URL redis-rs rejects.
pub(crate) fn redis_client(url: &str) -> Result<redis::Client> {
    let (url, params) = TlsParams::split(url)?;
    if !has_scheme(&url, "rediss://") {
        params.refuse_on_plain("a redis:// URL", "rediss://")?;
        return redis::Client::open(url.as_str()).map_err(bad_redis_url(&url));
    }
    if cfg!(not(feature = "tls")) {
        // Before reading any file: the build cannot use them.
        return redis_tls_client(url.as_str(), &TlsFiles::default());
    }
    // The URL before the certificates, so that its error names it.
    redis::IntoConnectionInfo::into_connection_info(url.as_str()).map_err(bad_redis_url(&url))?;
    redis_tls_client(url.as_str(), &params.read()?)
}

/// A redis-rs client over TLS to `info` (a `rediss://` URL or a `TcpTls` address) with the CA
/// and client certificate of `files` (the system trust store without a CA).
///
/// # Errors
/// [`Error::IssuerNotBuilt`] without the `tls` feature; [`InvalidInput::IssuerUrl`](crate::error::InvalidInput::IssuerUrl) for a URL
/// redis-rs rejects; [`Error::Backend`](crate::Error::Backend) for certificates it refuses.
#[cfg(feature = "tls")]
pub(crate) fn redis_tls_client(
    info: impl redis::IntoConnectionInfo,
    files: &TlsFiles,
) -> Result<redis::Client> {
    ensure_crypto_provider();
    // The URL first, so that a malformed one is the invalid-URL error with or without
    // certificates; what redis-rs refuses after that is about the certificates.
    let info = info
        .into_connection_info()
        .map_err(|e| crate::issuer::invalid_redis_url(None, &e))?;
    if files.ca.is_none() && files.identity.is_none() {
        return Ok(redis::Client::open(info)?);
    }
    Ok(redis::Client::build_with_tls(info, redis_certs(files))?)
}

/// Without the `tls` feature: [`Error::IssuerNotBuilt`].
#[cfg(not(feature = "tls"))]
pub(crate) fn redis_tls_client(
    _info: impl redis::IntoConnectionInfo,
    _files: &TlsFiles,
) -> Result<redis::Client> {
    Err(not_built("rediss://"))
}

/// A redis-rs Redis Cluster client for `nodes` (all `redis://` or all `rediss://`), with
/// pgfence's TLS parameters applied: they may be given on any node URL (they apply to every
/// node), and when given on several, they must be the same.
///
/// # Errors
/// As [`redis_client`]; [`InvalidInput::Tls`](crate::error::InvalidInput::Tls) when nodes give different TLS parameters.
pub(crate) fn redis_cluster_client(nodes: &[String]) -> Result<redis::cluster::ClusterClient> {
    let mut params: Option<TlsParams> = None;
    let mut urls = Vec::with_capacity(nodes.len());
    for node in nodes {
        let (url, given) = TlsParams::split(node)?;
        if !given.is_empty() {
            match &params {
                Some(before) if *before != given => {
                    return Err(Error::Invalid(InvalidInput::Tls(
                        "the node URLs give different TLS settings: give them on one node URL, \
                         or the same on each"
                            .into(),
                    )));
                }
                _ => params = Some(given),
            }
        }
        urls.push(url);
    }
    let params = params.unwrap_or_default();
    // Every node URL first: a malformed one is the invalid-URL error, TLS or not.
    for url in &urls {
        redis::IntoConnectionInfo::into_connection_info(url.as_str())
            .map_err(bad_redis_url(url))?;
    }
    if !urls.iter().any(|u| has_scheme(u, "rediss://")) {
        params.refuse_on_plain("a redis:// node URL", "rediss://")?;
        return redis::cluster::ClusterClient::new(urls)
            .map_err(|e| crate::issuer::invalid_redis_url(None, &e));
    }
    #[cfg(not(feature = "tls"))]
    {
        Err(not_built("rediss://"))
    }
    #[cfg(feature = "tls")]
    {
        ensure_crypto_provider();
        let mut builder = redis::cluster::ClusterClient::builder(urls);
        if !params.is_empty() {
            builder = builder.certs(redis_certs(&params.read()?));
        }
        Ok(builder.build()?)
    }
}

/// redis-rs's form of `files`.
#[cfg(feature = "tls")]
pub(crate) fn redis_certs(files: &TlsFiles) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: files
            .identity
            .as_ref()
            .map(|(cert, key)| redis::ClientTlsConfig {
                client_cert: cert.clone(),
                client_key: key.clone(),
            }),
        root_cert: files.ca.clone(),
    }
}

/// Whether `e` is a TLS failure (a certificate refused by either side, a failed handshake):
/// retrying the same connection does not help.
pub(crate) fn is_tls_rejection(e: &redis::RedisError) -> bool {
    #[cfg(feature = "tls")]
    {
        tls_rejection(e).is_some()
    }
    #[cfg(not(feature = "tls"))]
    {
        let _ = e;
        false
    }
}

/// The TLS error (a certificate the peer refused or we refused, a failed handshake) under
/// `e`, if any: a configuration problem that retrying does not fix.
#[cfg(feature = "tls")]
pub(crate) fn tls_rejection<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> Option<&'a rustls::Error> {
    type Shared = std::sync::Arc<dyn std::error::Error + Send + Sync>;
    let mut current = Some(e);
    // Bounded: error chains are short, and a cycle must not hang.
    for _ in 0..16 {
        let err = current?;
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(shared) = err.downcast_ref::<Shared>() {
            current = Some(&**shared);
            continue;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && let Some(inner) = io.get_ref()
        {
            if let Some(tls) = inner.downcast_ref::<rustls::Error>() {
                return Some(tls);
            }
            current = Some(inner);
            continue;
        }
        current = err.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_tls_parameters_off() {
        let (url, p) = TlsParams::split(
            "rediss://u:p@h:1/2?cacert=%2Ftmp%2Fca%20x.pem&protocol=resp3&cert=/c.pem&key=/k.pem#insecure",
        )
        .unwrap();
        assert_eq!(url, "rediss://u:p@h:1/2?protocol=resp3#insecure");
        assert_eq!(p.cacert.as_deref(), Some(Path::new("/tmp/ca x.pem")));
        assert_eq!(p.cert.as_deref(), Some(Path::new("/c.pem")));
        assert_eq!(p.key.as_deref(), Some(Path::new("/k.pem")));

        let (url, p) = TlsParams::split("rediss://h?cacert=/ca.pem").unwrap();
        assert_eq!((url.as_str(), p.is_empty()), ("rediss://h", false));
        let (url, p) = TlsParams::split("redis://h:1/0").unwrap();
        assert_eq!((url.as_str(), p.is_empty()), ("redis://h:1/0", true));

        for (bad, says) in [
            ("rediss://h?cert=/c.pem", "needs `key`"),
            ("rediss://h?key=/k.pem", "needs `cert`"),
            ("rediss://h?cacert=/a&cacert=/b", "twice"),
            ("rediss://h?cacert=", "names no file"),
            ("rediss://h?cacert=%zz", "percent-encoded"),
        ] {
            let err = TlsParams::split(bad).unwrap_err();
            assert!(
                matches!(err, Error::Invalid(InvalidInput::Tls(_))),
                "{bad}: {err}"
            );
            assert!(err.to_string().contains(says), "{bad}: {err}");
        }
    }

    #[test]
    fn tls_parameters_are_refused_on_plain_urls() {
        let (_, p) = TlsParams::split("redis://h?cacert=/ca.pem").unwrap();
        let err = p
            .refuse_on_plain("a redis:// URL", "rediss://")
            .unwrap_err();
        assert!(matches!(err, Error::Invalid(InvalidInput::Tls(_))), "{err}");
        assert!(err.to_string().contains("use rediss://"), "{err}");
        assert!(
            err.to_string().contains("`cacert` is a TLS setting"),
            "{err}"
        );
        let err = redis_client("redis://127.0.0.1:1?cert=/c&key=/k").unwrap_err();
        assert!(
            err.to_string().contains("`cert`, `key` are TLS settings"),
            "{err}"
        );
    }

    #[test]
    fn unreadable_or_wrong_files_are_named() {
        let missing = std::env::temp_dir().join(format!("pgfence-no-such-{}", std::process::id()));
        let p = TlsParams {
            cacert: Some(missing.clone()),
            ..TlsParams::default()
        };
        let err = p.read().unwrap_err();
        assert!(
            matches!(&err, Error::Invalid(InvalidInput::TlsFile { param: "cacert", path, .. }) if *path == missing),
            "{err}"
        );
        assert!(
            err.to_string().contains(&missing.display().to_string()),
            "{err}"
        );

        let not_pem = std::env::temp_dir().join(format!("pgfence-not-pem-{}", std::process::id()));
        std::fs::write(&not_pem, b"hello").unwrap();
        let p = TlsParams {
            cert: Some(not_pem.clone()),
            key: Some(not_pem.clone()),
            ..TlsParams::default()
        };
        let err = p.read().unwrap_err();
        std::fs::remove_file(&not_pem).ok();
        assert!(
            matches!(
                err,
                Error::Invalid(InvalidInput::TlsFile { param: "cert", .. })
            ),
            "{err}"
        );
    }

    #[cfg(not(feature = "tls"))]
    #[test]
    fn rediss_without_the_feature_names_it() {
        let err = redis_client("rediss://127.0.0.1:1").unwrap_err();
        assert!(
            matches!(err, Error::IssuerNotBuilt { feature: "tls", .. }),
            "{err}"
        );
    }

    #[cfg(feature = "tls")]
    #[test]
    fn installs_a_provider_once() {
        ensure_crypto_provider();
        ensure_crypto_provider();
        assert!(rustls::crypto::CryptoProvider::get_default().is_some());
    }
}
