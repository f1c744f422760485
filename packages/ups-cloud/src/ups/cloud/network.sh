# shellcheck shell=bash
# The address and interface the job's other machines reach this one on (a multi-machine job):
# sets UPS_LOCAL_ADDR, UPS_IFACE, and UPS_IS_HOST (1: this machine serves the rendezvous).
# $1: this machine's rank; $2: the rendezvous host; $3: the interface to use, or empty to
# find it (see StartupScript.network_interface in ups.cloud._startup).
ups_field() { awk -v key="$1" '{for (i = 1; i < NF; i++) if ($i == key) {print $(i + 1); exit}}'; }
ups_iface_addr() {
  { ip -4 -o addr show dev "$1" scope global 2>/dev/null || true; } | awk '{split($4, a, "/"); print a[1]; exit}'
}
ups_private_iface() {
  local def
  def=$({ ip -4 -o route show default 2>/dev/null || true; } | ups_field dev)
  ip -4 -o addr show scope global | awk -v def="$def" '
    $2 ~ /^(lo$|docker|br-|virbr|veth)/ {next}
    {split($4, a, "/"); split(a[1], o, ".")}
    !p && $2 != def && (o[1] == 10 || (o[1] == 172 && o[2] >= 16 && o[2] <= 31) ||
      (o[1] == 192 && o[2] == 168)) {p = $2}
    !d && $2 == def {d = $2}
    !f {f = $2}
    END {print p ? p : d ? d : f}'
}
ups_network() {
  local address route
  address=$(getent ahostsv4 "$2" | awk 'NR == 1 {print $1}' || true)
  route=$(ip -4 -o route get "${address:-$2}" 2>&1) || {
    ups_say "cannot reach the rendezvous host $2: $route"
    return 1
  }
  UPS_IS_HOST=0 UPS_IFACE=$3 UPS_LOCAL_ADDR=
  if [ "$(ups_field dev <<<"$route")" = lo ]; then UPS_IS_HOST=1; fi
  if [ -z "$UPS_IFACE" ] && [ "$UPS_IS_HOST" = 0 ]; then
    UPS_IFACE=$(ups_field dev <<<"$route")
    UPS_LOCAL_ADDR=$(ups_field src <<<"$route")
  elif [ -z "$UPS_IFACE" ]; then
    UPS_LOCAL_ADDR=$(ups_field src <<<"$route")
    case "$UPS_LOCAL_ADDR" in
      127.*) UPS_LOCAL_ADDR='' UPS_IFACE=$(ups_private_iface) ;;
      *) UPS_IFACE=$(ip -4 -o addr show | awk -v a="$UPS_LOCAL_ADDR" 'index($4, a "/") == 1 {print $2; exit}') ;;
    esac
  fi
  UPS_LOCAL_ADDR=${UPS_LOCAL_ADDR:-$(ups_iface_addr "$UPS_IFACE")}
  if [ -z "$UPS_IFACE" ] || [ -z "$UPS_LOCAL_ADDR" ]; then
    ups_say "no IPv4 address on ${UPS_IFACE:-any network interface} for the other machines to reach; set network_interface"
    return 1
  fi
  export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$UPS_IFACE}"
  export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$UPS_IFACE}"
  ups_say "network: machine $1 is $UPS_LOCAL_ADDR on $UPS_IFACE (GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME)"
}
