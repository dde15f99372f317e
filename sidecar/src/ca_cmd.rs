//! `tokentap ca init|show|path`: the local CA that transparent capture mints certificates from.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use tokentap_proxy::tls::{ca, CertificateAuthority};

#[derive(Args)]
pub struct CaArgs {
    /// Directory of the CA (default: $TOKENTAP_CA_DIR, else ~/.local/share/tokentap/ca).
    #[arg(long, env = "TOKENTAP_CA_DIR", global = true)]
    dir: Option<PathBuf>,
    #[command(subcommand)]
    command: CaCmd,
}

#[derive(Subcommand)]
enum CaCmd {
    /// Create the CA if there is none (the key file is readable by its owner only).
    Init,
    /// Print the CA certificate (PEM), to install where clients need to trust it.
    Show,
    /// Print the path of the CA certificate.
    Path,
    /// Write the system's CA store plus this CA, for SSL_CERT_FILE / REQUESTS_CA_BUNDLE in
    /// containers (they replace the system store, so both must be in it).
    Bundle {
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run(args: CaArgs) -> anyhow::Result<()> {
    let dir = args.dir.unwrap_or_else(ca::default_dir);
    match args.command {
        CaCmd::Init => {
            let (ca, created) = CertificateAuthority::load_or_create(&dir)?;
            println!(
                "{} {}",
                if created { "created" } else { "exists" },
                ca.cert_path().display()
            );
        }
        CaCmd::Show => print!("{}", CertificateAuthority::load(&dir)?.cert_pem()),
        CaCmd::Bundle { out } => {
            CertificateAuthority::load(&dir)?.write_bundle(&out)?;
            println!("{}", out.display());
        }
        CaCmd::Path => println!(
            "{}",
            CertificateAuthority::load(&dir)?.cert_path().display()
        ),
    }
    Ok(())
}
