//! `--bus`: records over NATS JetStream instead of a direct ship. The flags; the publisher
//! side (proxy, run, sidecar, node agent) is `tokentap_ship::downstream`; the worker side
//! (`tokentap worker --bus`, one member of a group that splits the partitions) is
//! `tokentap_ship::bus_worker`.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use tokentap_bus::topology::DEFAULT_PARTITIONS;
use tokentap_bus::{BusConnect, BusUser};

#[derive(Args, Clone, Default)]
pub struct BusArgs {
    /// Publish records to (or, for `worker`, consume them from) NATS JetStream at this URL
    /// (`nats://HOST:PORT`, or `tls://HOST:PORT`); NATS Server 2.9 or newer with JetStream
    /// enabled (`nats-server -js`).
    #[arg(long, value_name = "URL", env = "TOKENTAP_BUS")]
    pub bus: Option<String>,
    /// The NATS server's authorization token.
    #[arg(
        long,
        env = "TOKENTAP_BUS_TOKEN",
        hide_env_values = true,
        requires = "bus"
    )]
    pub bus_token: Option<String>,
    /// This process's user on the bus (a role of the server's `authorization { users }`:
    /// `publisher` for proxies, sidecars and node agents, `worker` for workers, `node` for
    /// rollout nodes; docs/scale-out.md, "Roles on the bus"). Its password comes from
    /// --bus-password-file or TOKENTAP_BUS_PASSWORD.
    #[arg(
        long,
        value_name = "USER",
        env = "TOKENTAP_BUS_USER",
        requires = "bus",
        conflicts_with = "bus_token"
    )]
    pub bus_user: Option<String>,
    /// A file holding the password of --bus-user (one line; a trailing newline is ignored).
    #[arg(
        long,
        value_name = "FILE",
        env = "TOKENTAP_BUS_PASSWORD_FILE",
        requires = "bus_user"
    )]
    pub bus_password_file: Option<PathBuf>,
    /// The password of --bus-user, from the environment only (a command line is readable by
    /// every user of the machine).
    #[arg(
        long,
        env = "TOKENTAP_BUS_PASSWORD",
        hide_env_values = true,
        hide = true,
        requires = "bus_user",
        conflicts_with = "bus_password_file"
    )]
    pub bus_password: Option<String>,
    /// CA certificates (PEM) the bus's TLS certificate chains to; requires TLS.
    #[arg(long, value_name = "PEM", requires = "bus")]
    pub bus_ca: Option<PathBuf>,
    /// Partitions of the records stream, used by the first process on a new bus (the bus
    /// keeps the count; later values are ignored). More partitions than workers, always.
    #[arg(long, default_value_t = DEFAULT_PARTITIONS, requires = "bus")]
    pub bus_partitions: u32,
}

impl BusArgs {
    /// Where the bus is and the credentials to present there (None: no --bus).
    pub fn connect(&self) -> anyhow::Result<Option<BusConnect>> {
        let Some(url) = &self.bus else {
            return Ok(None);
        };
        let user = match &self.bus_user {
            None => None,
            Some(name) => {
                let password = match (&self.bus_password_file, &self.bus_password) {
                    (Some(file), _) => {
                        let text = std::fs::read_to_string(file).with_context(|| {
                            format!("reading --bus-password-file {}", file.display())
                        })?;
                        text.trim_end_matches(['\r', '\n']).to_owned()
                    }
                    (None, Some(password)) => password.clone(),
                    (None, None) => anyhow::bail!(
                        "--bus-user needs its password: --bus-password-file FILE or TOKENTAP_BUS_PASSWORD"
                    ),
                };
                if password.is_empty() {
                    anyhow::bail!("the password of --bus-user {name} is empty");
                }
                Some(BusUser {
                    name: name.clone(),
                    password,
                })
            }
        };
        Ok(Some(BusConnect {
            url: url.clone(),
            token: self.bus_token.clone(),
            user,
            ca: self.bus_ca.clone(),
        }))
    }
}
