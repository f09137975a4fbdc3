//! Throwaway TLS certificates, made per run with the `openssl` command: a CA, a server
//! certificate for `localhost` / `127.0.0.1` / `::1` signed by it, and client certificates
//! (the subject's CN is the user name PostgreSQL's `cert` authentication and etcd's client
//! certificate authentication read).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::ServerError;

/// A CA with a server certificate and client certificates, in a temporary directory that is
/// removed when this is dropped. Files are PEM; keys are unencrypted (PKCS#8) and readable by
/// every local user (throwaway test keys: servers that insist on private key files copy them).
#[derive(Debug)]
pub struct Certs {
    dir: PathBuf,
    openssl: PathBuf,
}

impl Certs {
    /// Makes a CA and a server certificate for `localhost`, `127.0.0.1` and `::1`.
    ///
    /// # Errors
    /// [`ServerError::NotInstalled`] without `openssl`; [`ServerError::StartFailed`] when it
    /// fails.
    pub fn generate() -> Result<Self, ServerError> {
        let openssl = crate::find_in_path("openssl").ok_or(ServerError::NotInstalled {
            what: "openssl",
            hint: "install OpenSSL's command line tool (Debian: apt-get install openssl)",
        })?;
        let dir = crate::process::temp_dir("pgfence-certs")?;
        let certs = Self { dir, openssl };
        certs.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=pgfence test CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ])?;
        std::fs::write(
            certs.dir.join("server.ext"),
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
             extendedKeyUsage=serverAuth,clientAuth\n\
             subjectAltName=DNS:localhost,IP:127.0.0.1,IP:::1\n",
        )?;
        certs.sign("server", "localhost", "server.ext")?;
        certs.open_up()?;
        Ok(certs)
    }

    /// Makes (or returns) a client certificate whose subject CN is `user`:
    /// `(certificate, key)`.
    ///
    /// # Errors
    /// As [`Certs::generate`].
    pub fn client(&self, user: &str) -> Result<(PathBuf, PathBuf), ServerError> {
        let stem = format!(
            "client-{}",
            user.chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect::<String>()
        );
        let (cert, key) = (
            self.dir.join(format!("{stem}.crt")),
            self.dir.join(format!("{stem}.key")),
        );
        if cert.is_file() && key.is_file() {
            return Ok((cert, key));
        }
        std::fs::write(
            self.dir.join("client.ext"),
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
             extendedKeyUsage=clientAuth\n",
        )?;
        self.sign(&stem, user, "client.ext")?;
        self.open_up()?;
        Ok((cert, key))
    }

    /// Runs `openssl ARGS` in the directory; its stderr on failure.
    fn openssl(&self, args: &[&str]) -> Result<(), ServerError> {
        let out = Command::new(&self.openssl)
            .args(args)
            .current_dir(&self.dir)
            .output()?;
        if out.status.success() {
            return Ok(());
        }
        Err(ServerError::StartFailed {
            what: "openssl",
            detail: format!(
                "openssl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        })
    }

    /// A key and a certificate for `cn` signed by the CA: `{stem}.key`, `{stem}.crt`.
    fn sign(&self, stem: &str, cn: &str, ext: &str) -> Result<(), ServerError> {
        let (key, csr, crt) = (
            format!("{stem}.key"),
            format!("{stem}.csr"),
            format!("{stem}.crt"),
        );
        let subj = format!("/CN={cn}");
        self.openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &subj,
        ])?;
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "2",
            "-extfile",
            ext,
        ])
    }

    /// Lets servers running as another user (PostgreSQL as `postgres`) read the files.
    fn open_up(&self) -> Result<(), ServerError> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o755))?;
        for entry in std::fs::read_dir(&self.dir)? {
            let path = entry?.path();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
        }
        Ok(())
    }

    /// The directory holding the files.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CA certificate (PEM): what clients trust (`sslrootcert`, `cacert`).
    #[must_use]
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// The server certificate (PEM), for `localhost`, `127.0.0.1` and `::1`.
    #[must_use]
    pub fn server_cert(&self) -> PathBuf {
        self.dir.join("server.crt")
    }

    /// The server certificate's key (PEM).
    #[must_use]
    pub fn server_key(&self) -> PathBuf {
        self.dir.join("server.key")
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
