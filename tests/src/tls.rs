//! A TLS front for test upstreams: a throwaway CA (rcgen), a certificate for 127.0.0.1 and
//! localhost signed by it, and a listener that terminates TLS and relays bytes to a plain
//! upstream. Providers are tested over real TLS without a network.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A running TLS front; stops when dropped. `ca_file` is the CA's PEM, for `caFile`.
pub struct TlsFront {
    pub addr: SocketAddr,
    pub ca_file: PathBuf,
    _dir: tempfile::TempDir,
    task: tokio::task::JoinHandle<()>,
}

impl TlsFront {
    /// Terminate TLS on 127.0.0.1 and relay each connection to `backend`.
    pub async fn start(backend: SocketAddr) -> TlsFront {
        let certs = TestCerts::generate();
        let dir = tempfile::tempdir().expect("tempdir");
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, &certs.ca_pem).expect("write ca");
        let (leaf, leaf_key) = (certs.leaf, certs.leaf_key);

        let config = ServerConfig::builder_with_provider(Arc::new(
            tokio_rustls::rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("tls versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from(leaf.der().to_vec())],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
        )
        .expect("server config");
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind tls");
        let addr = listener.local_addr().expect("tls addr");
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(socket).await else {
                        return;
                    };
                    if let Ok(mut plain) = TcpStream::connect(backend).await {
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                    }
                });
            }
        });
        TlsFront {
            addr,
            ca_file,
            _dir: dir,
            task,
        }
    }
}

/// A throwaway CA and a certificate for 127.0.0.1 and localhost signed by it.
pub struct TestCerts {
    pub ca_pem: String,
    pub leaf: rcgen::Certificate,
    pub leaf_key: rcgen::KeyPair,
}

impl TestCerts {
    pub fn generate() -> TestCerts {
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("ca params");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "switchyard test CA");
        let ca_key = rcgen::KeyPair::generate().expect("ca key");
        let ca = ca_params.self_signed(&ca_key).expect("ca cert");
        let leaf_params =
            rcgen::CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
                .expect("leaf params");
        let leaf_key = rcgen::KeyPair::generate().expect("leaf key");
        let leaf = leaf_params
            .signed_by(&leaf_key, &ca, &ca_key)
            .expect("leaf cert");
        TestCerts {
            ca_pem: ca.pem(),
            leaf,
            leaf_key,
        }
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}
