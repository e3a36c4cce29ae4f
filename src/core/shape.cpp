#include "cumulus/core/shape.h"

#include "core/check.h"

namespace cumulus {

bool head_dim_supported(int head_dim) { return head_dim >= 8 && head_dim <= 256 && head_dim % 8 == 0; }

void Shape::validate() const {
  CUMULUS_CHECK(n_layers > 0, "n_layers={} must be positive", n_layers);
  CUMULUS_CHECK(n_q_heads > 0, "n_q_heads={} must be positive", n_q_heads);
  CUMULUS_CHECK(n_kv_heads > 0, "n_kv_heads={} must be positive", n_kv_heads);
  CUMULUS_CHECK(n_q_heads % n_kv_heads == 0, "n_q_heads={} must be a multiple of n_kv_heads={}", n_q_heads,
                n_kv_heads);
  CUMULUS_CHECK(head_dim_supported(head_dim), "head_dim={} is not supported (multiples of 8 in [8, 256])",
                head_dim);
}

}  // namespace cumulus
