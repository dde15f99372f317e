//! The node agent's domain: which workloads (containers, pods) on this host are captured, under
//! which session, and in which cgroup they run. Sources ([`docker`], [`kubernetes`]) watch
//! their API and report [`WorkloadEvent`]s; the agent (wired in the `tokentap node-agent`
//! command) attaches the eBPF redirect to each workload's cgroup and detaches it when the
//! workload ends.
//!
//! Dependencies point one way: sources → [`workload`] types; [`agent`] → [`attribution`],
//! the eBPF loader and the proxy's listener trait. The sources know nothing of eBPF or the
//! proxy. [`sources`] starts the ones a host was given, feeding one channel; [`status`] is the
//! agent's status plane (its workloads and metrics, behind the control plane's token).

pub mod agent;
pub mod attribution;
pub mod docker;
pub mod kubelet_cgroup;
pub mod kubernetes;
pub mod sources;
pub mod status;
pub mod workload;

pub use workload::{Workload, WorkloadEvent, WorkloadKey};
