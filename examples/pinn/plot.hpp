#pragma once
// A minimal PNG figure writer for examples/burgers_pinn: heatmaps of fields on a (t, x)
// grid side by side, each with a title, axis ticks and a colour bar, rendered into an RGB
// bitmap with a built-in 5x7 pixel font and written with stb_image_write (libstb-dev).
// Not part of the library.
#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace pinn::plot {

/// An RGB image, row-major, 3 bytes per pixel, white background.
struct Image {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
  Image(int w, int h) : width(w), height(h), rgb(std::size_t(w) * std::size_t(h) * 3, 255) {}
  void set(int x, int y, std::array<uint8_t, 3> c) {
    if (x < 0 || y < 0 || x >= width || y >= height) return;
    std::size_t i = (std::size_t(y) * std::size_t(width) + std::size_t(x)) * 3;
    rgb[i] = c[0], rgb[i + 1] = c[1], rgb[i + 2] = c[2];
  }
};

/// Viridis (matplotlib's perceptually uniform map), linear between nine of its samples;
/// v in [0, 1].
inline std::array<uint8_t, 3> viridis(double v) {
  static constexpr uint8_t kAnchors[9][3] = {{68, 1, 84},    {71, 44, 122},  {59, 81, 139},
                                             {44, 113, 142}, {33, 144, 141}, {39, 173, 129},
                                             {92, 200, 99},  {170, 220, 50}, {253, 231, 37}};
  v = std::clamp(std::isfinite(v) ? v : 0.0, 0.0, 1.0) * 8;
  const int i = std::min(int(v), 7);
  const double f = v - i;
  std::array<uint8_t, 3> c{};
  for (int k = 0; k < 3; ++k)
    c[std::size_t(k)] = uint8_t(std::lround(kAnchors[i][k] * (1 - f) + kAnchors[i + 1][k] * f));
  return c;
}

/// 5x7 glyphs (one byte per row, bit 4 = leftmost column) of the characters the figure
/// uses; any other character is drawn as a blank.
inline const uint8_t* glyph(char ch) {
  struct G { char c; uint8_t rows[7]; };
  static constexpr G kFont[] = {
      {'0', {14, 17, 19, 21, 25, 17, 14}}, {'1', {4, 12, 4, 4, 4, 4, 14}},
      {'2', {14, 17, 1, 2, 4, 8, 31}},     {'3', {31, 2, 4, 2, 1, 17, 14}},
      {'4', {2, 6, 10, 18, 31, 2, 2}},     {'5', {31, 16, 30, 1, 1, 17, 14}},
      {'6', {6, 8, 16, 30, 17, 17, 14}},   {'7', {31, 1, 2, 4, 8, 8, 8}},
      {'8', {14, 17, 17, 14, 17, 17, 14}}, {'9', {14, 17, 17, 15, 1, 2, 12}},
      {'.', {0, 0, 0, 0, 0, 12, 12}},      {'-', {0, 0, 0, 31, 0, 0, 0}},
      {'+', {0, 4, 4, 31, 4, 4, 0}},       {'(', {2, 4, 8, 8, 8, 4, 2}},
      {')', {8, 4, 2, 2, 2, 4, 8}},        {',', {0, 0, 0, 0, 12, 4, 8}},
      {'|', {4, 4, 4, 4, 4, 4, 4}},        {'=', {0, 0, 31, 0, 31, 0, 0}},
      {'a', {0, 0, 14, 1, 15, 17, 15}},    {'c', {0, 0, 14, 16, 16, 17, 14}},
      {'d', {1, 1, 13, 19, 17, 17, 15}},   {'e', {0, 0, 14, 17, 31, 16, 14}},
      {'i', {4, 0, 12, 4, 4, 4, 14}},      {'l', {12, 4, 4, 4, 4, 4, 14}},
      {'n', {0, 0, 22, 25, 17, 17, 17}},   {'o', {0, 0, 14, 17, 17, 17, 14}},
      {'p', {0, 0, 30, 17, 30, 16, 16}},   {'r', {0, 0, 22, 25, 16, 16, 16}},
      {'s', {0, 0, 14, 16, 14, 1, 30}},    {'t', {8, 8, 28, 8, 8, 9, 6}},
      {'u', {0, 0, 17, 17, 17, 19, 13}},   {'x', {0, 0, 17, 10, 4, 10, 17}},
      {'L', {16, 16, 16, 16, 16, 16, 31}},
  };
  for (const auto& g : kFont)
    if (g.c == ch) return g.rows;
  return nullptr;
}

/// Draws `text` with its top-left corner at (x, y), each font pixel `scale` pixels.
inline void text(Image& img, int x, int y, const std::string& s, int scale = 2) {
  for (char ch : s) {
    if (const uint8_t* rows = glyph(ch))
      for (int r = 0; r < 7; ++r)
        for (int c = 0; c < 5; ++c)
          if (rows[r] & (16 >> c))
            for (int dy = 0; dy < scale; ++dy)
              for (int dx = 0; dx < scale; ++dx) img.set(x + c * scale + dx, y + r * scale + dy, {0, 0, 0});
    x += 6 * scale;
  }
}

inline int text_width(const std::string& s, int scale = 2) { return int(s.size()) * 6 * scale; }

/// A tick label: 3 significant digits, exponent without padding ("1e-03" -> "1e-3").
inline std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  std::string s = buf;
  auto e = s.find('e');
  if (e != std::string::npos) {
    std::string mant = s.substr(0, e), exp = s.substr(e + 1);
    const bool neg = exp[0] == '-';
    exp = exp.substr(exp[0] == '-' || exp[0] == '+' ? 1 : 0);
    while (exp.size() > 1 && exp[0] == '0') exp.erase(0, 1);
    s = mant + "e" + (neg ? "-" : "") + exp;
  }
  return s;
}

/// One heatmap: `field` [nt, nx] (row i is time i) shown with t to the right and x upwards,
/// values mapped onto viridis over [lo, hi].
struct Panel {
  std::string title;
  at::Tensor field;
  double lo, hi;
};

/// Lays the panels out side by side: title above each, x ticks (-1, 0, 1) on the left,
/// t ticks (0, 0.5, 1) below, a colour bar with min, middle and max labels on the right.
/// Each grid cell is `cell_w` x `cell_h` pixels.
inline Image render(const std::vector<Panel>& panels, double t0, double t1, double x0, double x1,
                    int cell_w = 3, int cell_h = 1) {
  const int nt = int(panels.at(0).field.size(0)), nx = int(panels.at(0).field.size(1));
  const int pw = nt * cell_w, ph = nx * cell_h;
  const int left = 40, top = 30, bar_gap = 8, bar_w = 14, bar_labels = 64, gap = 24, bottom = 44;
  const int block = left + pw + bar_gap + bar_w + bar_labels + gap;
  Image img(block * int(panels.size()), top + ph + bottom);
  auto fmt_axis = [](double v) { return number(v); };
  for (std::size_t k = 0; k < panels.size(); ++k) {
    const Panel& p = panels[k];
    const int ox = int(k) * block + left, oy = top;
    at::Tensor f = p.field.to(at::kDouble).contiguous();
    auto a = f.accessor<double, 2>();
    const double span = p.hi > p.lo ? p.hi - p.lo : 1;
    for (int i = 0; i < nt; ++i)
      for (int j = 0; j < nx; ++j) {
        auto c = viridis((a[i][j] - p.lo) / span);
        for (int dy = 0; dy < cell_h; ++dy)
          for (int dx = 0; dx < cell_w; ++dx)
            img.set(ox + i * cell_w + dx, oy + (nx - 1 - j) * cell_h + dy, c);  // x upwards
      }
    text(img, ox + (pw - text_width(p.title)) / 2, 6, p.title);
    // x axis (vertical): ticks at x0, the middle, x1.
    for (int q = 0; q <= 2; ++q) {
      const int y = oy + (ph - 1) - q * (ph - 1) / 2;
      for (int d = 1; d <= 4; ++d) img.set(ox - d, y, {0, 0, 0});
      const std::string s = fmt_axis(x0 + (x1 - x0) * q / 2);
      text(img, ox - 6 - text_width(s, 1), y - 3, s, 1);
    }
    text(img, ox - 34, oy + ph / 2 - 20, "x");
    // t axis (horizontal).
    for (int q = 0; q <= 2; ++q) {
      const int x = ox + q * (pw - 1) / 2;
      for (int d = 1; d <= 4; ++d) img.set(x, oy + ph - 1 + d, {0, 0, 0});
      const std::string s = fmt_axis(t0 + (t1 - t0) * q / 2);
      text(img, x - text_width(s, 1) / 2, oy + ph + 6, s, 1);
    }
    text(img, ox + pw / 2 - 5, oy + ph + 18, "t");
    // Colour bar: hi at the top.
    const int bx = ox + pw + bar_gap;
    for (int y = 0; y < ph; ++y) {
      auto c = viridis(1.0 - double(y) / double(ph - 1));
      for (int x = 0; x < bar_w; ++x) img.set(bx + x, oy + y, c);
    }
    for (int q = 0; q <= 2; ++q) {
      const int y = oy + q * (ph - 1) / 2;
      for (int d = 0; d < 3; ++d) img.set(bx + bar_w + d, y, {0, 0, 0});
      text(img, bx + bar_w + 5, y - 3, number(p.hi - (p.hi - p.lo) * q / 2), 1);
    }
  }
  return img;
}

}  // namespace pinn::plot
